"""Speculative decoding: proposals (prompt lookup or a draft model) verified in one step of the
paged engine (docs/speculative.md).

This package holds the parts both sides use, host only (no JAX): `config` (SpeculativeConfig),
`ngram_proposer` (prompt lookup) and `stats` (acceptance counters). What the scheduler adds to a
step (proposals, their slots, their sample rows, the rollback after it) is
`jpaged.core.speculation`; the draft model, its KV pool and its proposal loop are
`jpaged.runner.draft_proposer`.
"""
from jpaged.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
