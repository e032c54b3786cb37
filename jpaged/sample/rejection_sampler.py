"""Verification of proposals: accept the longest prefix the target itself would have produced.

A step computes a speculating sequence's last token and its proposals ``d_1 .. d_k`` in one pass,
and samples one row after each: row ``j`` reads the logits after ``d_j`` (row 0 after the last
token) with the sequence's own sampling settings as they would be there (penalties counting
``d_1 .. d_j``, ``min_tokens`` bans, bad words), and its own random stream at that output index
(``fold_in(seed, num_output_tokens + j)``, `jpaged.sample.sampler`). Proposal ``d_{j+1}`` is
accepted while every earlier one was and row ``j`` sampled exactly it; the first row that sampled
something else gives the correction token, and with every proposal accepted row ``k`` gives a bonus
token. A step thus yields ``accepted + 1`` tokens.

This is the standard rejection-sampling rule for a proposal that puts all its mass on one token
(prompt lookup, and the draft model's greedy proposal): accept ``d`` with probability ``p(d)``,
else draw from ``p`` with ``d`` removed, renormalized. Here both draws come from the row's Gumbel
noise: the row's sample is ``d`` with probability ``p(d)``, and given it is not ``d`` it is
distributed as ``p`` without ``d``. Coupled this way, every token a sequence outputs is the very
token it would have sampled without speculation (given the same earlier tokens): greedy output is
identical, and a seeded sampled request gives the same tokens with or without speculation (up to
float rounding of the verification pass), so the output distribution is exactly the target's.
"""
import numpy as np


def leading_matches(sampled, drafts, xp=np):
    """Accepted proposals per sequence.

    Args:
      sampled: int [S, K + 1]: each sequence's sampled rows in order (row j after proposal j).
      drafts: int [S, K]: its proposals, padded with -1 (never sampled, so never accepted).
      xp: ``numpy`` on the host, ``jax.numpy`` on the device.

    Returns:
      int32 [S]: how many leading proposals equal the token sampled before them.
    """
    matches = (sampled[:, :drafts.shape[1]] == drafts).astype(xp.int32)
    return xp.sum(xp.cumprod(matches, axis=1), axis=1).astype(xp.int32)


def verification_layout(out) -> tuple[np.ndarray, np.ndarray]:
    """(rows [S, K + 1], drafts [S, K]) of a step's sequences (S = ``len(out.seqs)``, K = the most
    proposals of any): each sequence's sample rows by ``spec_index`` (-1 where it has none), and its
    proposals padded with -1. A sequence without proposals has its one row (or none) and no drafts."""
    k = max((len(s.spec_token_ids) for s in out.seqs), default=0)
    rows = np.full((len(out.seqs), k + 1), -1, np.int64)
    drafts = np.full((len(out.seqs), k), -1, np.int64)
    for i, row in enumerate(out.sample_rows):
        if row.spec_index or rows[row.seq_row, 0] < 0:  # n > 1 first samples: the first row stands in
            rows[row.seq_row, row.spec_index] = i
    for s, seq in enumerate(out.seqs):
        drafts[s, :len(seq.spec_token_ids)] = seq.spec_token_ids
    return rows, drafts


def num_accepted(out, tokens: np.ndarray) -> np.ndarray | None:
    """Accepted proposals per sequence of ``out`` given the step's sampled ``tokens`` (one per
    sample row); None for a step without speculation (no proposals, no draft look-ahead)."""
    if not any(s.spec_token_ids or s.num_lookahead_tokens for s in out.seqs):
        return None
    rows, drafts = verification_layout(out)
    sampled = np.where(rows >= 0, np.asarray(tokens)[np.maximum(rows, 0)], -2)
    return leading_matches(sampled, drafts)
