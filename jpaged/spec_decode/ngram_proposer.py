"""Prompt lookup (n-gram) proposals: where the sequence's last n tokens occurred before, guess that
what followed them then follows again.

A model asked to repeat, quote or edit a text copies long runs of its context; there each guess
saves a decode step. Host only (numpy), a few tens of microseconds per sequence.
"""
import numpy as np


class NgramProposer:
    """Proposes up to ``k`` tokens: the longest suffix of ``min_n`` .. ``max_n`` tokens that occurs
    earlier in the sequence (its latest occurrence), and the tokens that followed it there."""

    def __init__(self, min_n: int, max_n: int, k: int):
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` proposed next tokens of ``token_ids`` (maybe none)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        n = len(token_ids)
        if k <= 0 or n < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids)
        # ends[i]: an earlier position whose token equals the last one; extended leftwards while
        # the n-gram ending there keeps matching the sequence's suffix
        ends = np.flatnonzero(tokens[:n - 1] == tokens[n - 1])
        best, length = ends, 1
        while len(ends) and length < self.max_n:
            ends = ends[ends >= length]
            ends = ends[tokens[ends - length] == tokens[n - 1 - length]]
            if len(ends):
                best, length = ends, length + 1
        if not len(best) or length < self.min_n:
            return []
        start = int(best[-1]) + 1
        return tokens[start:start + k].tolist()
