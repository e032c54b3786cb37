"""Speculative decoding: proposals (prompt lookup or a draft model) verified in one step of the
paged engine (docs/speculative.md).

Host parts (no JAX): `config` (SpeculativeConfig), `ngram_proposer`, `scheduling` (what the
scheduler adds to a step: proposals, their slots, their sample rows, the rollback after it) and
`stats` (acceptance counters). Device part: `draft_proposer` (the draft model, its KV pool and its
proposal loop).
"""
from jpaged.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
