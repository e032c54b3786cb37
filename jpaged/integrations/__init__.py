"""Integrations of jpaged with other frameworks (Tunix)."""
