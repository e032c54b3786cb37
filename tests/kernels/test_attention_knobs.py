"""The jnp paged attention's ``sliding_window`` and ``logits_soft_cap`` against plain numpy loops.

A query at position p sees keys ``p - window < j <= p`` (transformers' sliding-window mask), and a
scaled score s becomes ``cap * tanh(s / cap)``. Every slot no query may see holds NaN, and the
block-table entries of blocks wholly before a window point at a NaN block: one that reached the
output unmasked would show.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk


def np_attention(q, k_pages, v_pages, tables, seq_lens, qsl, num_seqs, scale, window=None, cap=None):
    """Each query row's attention, one key at a time (float64)."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    bs, group = k_pages.shape[2], q.shape[1] // k_pages.shape[0]
    out = np.zeros_like(q)
    for s in range(num_seqs):
        q_len = qsl[s + 1] - qsl[s]
        for i in range(q_len):
            pos = seq_lens[s] - q_len + i
            first = 0 if window is None else max(0, pos - window + 1)
            slots = [(tables[s][j // bs], j % bs) for j in range(first, pos + 1)]
            keys = np.stack([k_pages[:, b, o] for b, o in slots], 1).repeat(group, 0)  # [Hq, keys, D]
            vals = np.stack([v_pages[:, b, o] for b, o in slots], 1).repeat(group, 0)
            scores = scale * np.einsum("hd,hkd->hk", q[qsl[s] + i], keys)
            if cap is not None:
                scores = cap * np.tanh(scores / cap)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            out[qsl[s] + i] = np.einsum("hk,hkd->hd", w / w.sum(-1, keepdims=True), vals)
    return out


def build(seqs, *, block_size=4, window=None, num_kv_heads=2, group=2, head_dim=16, max_seqs=None, seed=0):
    """A step of sequences (q_len, context): tables, a pool that is NaN where no query may look,
    and queries; the entries of blocks wholly before each window point at an all-NaN block."""
    rng = np.random.default_rng(seed)
    bs = block_size
    max_seqs = max_seqs or len(seqs)
    blocks = [-(-ctx // bs) for _, ctx in seqs]
    num_blocks = sum(blocks) + 1
    nan_block = num_blocks - 1
    tables = np.full((max_seqs, max(blocks) + 1), nan_block, np.int32)
    perm = rng.permutation(num_blocks - 1)
    visible = np.zeros((num_blocks, bs), bool)
    for s, (q_len, ctx) in enumerate(seqs):
        tables[s, :blocks[s]], perm = perm[:blocks[s]], perm[blocks[s]:]
        first = 0 if window is None or q_len == 0 else max(0, ctx - q_len - window + 1)
        tables[s, :first // bs] = nan_block  # never read: wholly before the first query's window
        for p in range(first, ctx):
            visible[tables[s, p // bs], p % bs] = True
    shape = (num_kv_heads, num_blocks, bs, head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    k[:, ~visible], v[:, ~visible] = np.nan, np.nan
    q_lens = [n for n, _ in seqs]
    qsl = np.full(max_seqs + 1, sum(q_lens), np.int32)
    qsl[0], qsl[1:len(seqs) + 1] = 0, np.cumsum(q_lens)
    seq_lens = np.zeros(max_seqs, np.int32)
    seq_lens[:len(seqs)] = [ctx for _, ctx in seqs]
    q = rng.standard_normal((sum(q_lens) + 2, num_kv_heads * group, head_dim))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return f32(q), f32(k), f32(v), jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(qsl), len(seqs)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "logits_soft_cap", "num_queries_per_block",
                                             "pages_per_compute_block"))
def ragged(*args, **kwargs):
    return pk.ragged_paged_attention_reference(*args, **kwargs)


MIXED = [(1, 40), (1, 3), (37, 37), (5, 29), (3, 60), (12, 12), (1, 17), (6, 10)]  # (q_len, context)


@pytest.mark.parametrize("window, cap, split", [
    (6, None, {}),
    (6, None, dict(num_queries_per_block=4, pages_per_compute_block=1)),  # many chunks, one block a step
    (13, 5.0, {}),
])
def test_ragged_reference_with_window_and_cap_vs_numpy(window, cap, split):
    """Decode rows, whole prompts, chunks that start past the window, and contexts shorter than it."""
    q, k, v, tables, seq_lens, qsl, n = build(MIXED, window=window, block_size=4 if cap is None else 8,
                                              group=2 if cap is None else 4, max_seqs=10)
    out = np.asarray(ragged(q, k, v, tables, seq_lens, qsl, n, scale=0.3, sliding_window=window,
                            logits_soft_cap=cap, **split))
    assert not np.isnan(out).any(), "a slot outside every window was read"
    expected = np_attention(q, k, v, np.asarray(tables), np.asarray(seq_lens), np.asarray(qsl), n, 0.3, window, cap)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("knobs, field", [(dict(sliding_window=0), "sliding_window"),
                                          (dict(logits_soft_cap=0.0), "logits_soft_cap")])
def test_bad_knobs_raise(knobs, field):
    q, k, v, tables, seq_lens, qsl, n = build([(2, 5)])
    with pytest.raises(ValueError, match=field):
        pk.ragged_paged_attention_reference(q, k, v, tables, seq_lens, qsl, n, scale=1.0, **knobs)
