"""The jnp paged MLA kernel: a ragged batch of prefill and decode tokens over the latent pool.

Each query token is one row: it attends causally to its sequence's latent rows ``0 .. position``,
read through the block table ``pages_per_compute_block`` blocks at a time with an online (flash)
softmax. The loop's trip count is the step's longest context, computed at run time
(``lax.fori_loop`` with a dynamic bound), so padding and unused block-table columns cost nothing
and add no compiled shape. All heads of a token share the rows they read.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.shapes import DEFAULT_MASK_VALUE, cdiv

PAGES_PER_STEP = 4  # blocks per online-softmax step


def split_latent(latent, pool_heads: int = 1):
    """The pool's (K half, V half) of latent rows ``[T, W]``: each ``[T, pool_heads, W/2]`` (the
    row repeated for each replica head), as `write_kv` takes them."""
    t, w = latent.shape
    half = w // 2
    k = jnp.broadcast_to(latent[:, None, :half], (t, pool_heads, half))
    v = jnp.broadcast_to(latent[:, None, half:], (t, pool_heads, half))
    return k, v


def latent_rows(k_pages, v_pages, block_ids):
    """The latent rows of head 0 of the given blocks: ``block_ids [...]`` ->
    ``[..., block_size, W]``."""
    return jnp.concatenate([k_pages[0, block_ids], v_pages[0, block_ids]], axis=-1)


def token_positions(query_start_loc, seq_lens, num_seqs, num_tokens: int):
    """(sequence index [T], position [T], context length [T]: 0 for padding) of each flat token."""
    qsl = query_start_loc.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(qsl[1:], t, side="right"), 0, seq_lens.shape[0] - 1)
    q_len = qsl[seq + 1] - qsl[seq]
    pos = seq_lens[seq] - q_len + (t - qsl[seq])
    real = t < qsl[num_seqs]
    return seq, pos, jnp.where(real, pos + 1, 0)


def mla_paged_attention_reference(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, num_seqs, *,
                                  kv_lora_rank: int, scale: float, pages_per_compute_block: int | None = None):
    """Ragged MLA attention through the latent pool.

    Args:
      q: ``[num_tokens, num_heads, W]``: each head's query in the latent space (its no-rope part
        absorbed through the key up-projection, ``kv_lora_rank`` values, then its rope part);
        rows ``query_start_loc[s]:query_start_loc[s + 1]`` belong to sequence ``s``.
      k_pages, v_pages: ``[pool_heads, num_blocks, block_size, W/2]``, the latent rows' halves
        (this step's rows already written).
      block_tables: int32 ``[max_seqs, max_blocks_per_seq]``.
      seq_lens: int32 ``[max_seqs]``, context length including this step's tokens.
      query_start_loc: int32 ``[max_seqs + 1]``; num_seqs: int32 scalar.
      kv_lora_rank: the width of the value part (``c_kv``) at the front of each row.
      scale: softmax scale of ``q . row``.
      pages_per_compute_block: blocks per online-softmax step (default ``PAGES_PER_STEP``).

    Returns:
      ``[num_tokens, num_heads, kv_lora_rank]`` in ``q.dtype``: each token's softmax-weighted sum
      of ``c_kv`` over its visible rows; padding rows are zeros.
    """
    num_tokens, num_heads, width = q.shape
    if 2 * k_pages.shape[-1] != width or v_pages.shape != k_pages.shape:
        raise ValueError(f"q width {width} != the latent pool's row width 2 * {k_pages.shape[-1]} "
                         f"(k_pages {k_pages.shape}, v_pages {v_pages.shape})")
    if not 0 < kv_lora_rank <= width:
        raise ValueError(f"kv_lora_rank={kv_lora_rank}: must be in (0, {width}]")
    block_size = k_pages.shape[2]
    pages = pages_per_compute_block or PAGES_PER_STEP
    bk = pages * block_size
    seq, _, kv_len = token_positions(query_start_loc, seq_lens, num_seqs, num_tokens)
    tables = block_tables.astype(jnp.int32)[seq]                       # [T, B]
    qf = q.astype(jnp.float32)

    def step(j, carry):
        m_prev, l_prev, acc_prev = carry
        cols = jnp.minimum(j * pages + jnp.arange(pages), tables.shape[1] - 1)
        rows = latent_rows(k_pages, v_pages, tables[:, cols]).reshape(num_tokens, bk, width)
        k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)
        seen = k_pos[None, :] < kv_len[:, None]                        # [T, K]
        rows = jnp.where(seen[..., None], rows.astype(jnp.float32), 0.0)
        s = jnp.einsum("thw,tkw->thk", qf, rows) * scale
        s = jnp.where(seen[:, None], s, DEFAULT_MASK_VALUE)
        m = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(seen[:, None], jnp.exp(s - m), 0.0)
        alpha = jnp.exp(m_prev - m)
        l = alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True)
        acc = alpha * acc_prev + jnp.einsum("thk,tkr->thr", p, rows[..., :kv_lora_rank])
        return m, l, acc

    init = (jnp.full((num_tokens, num_heads, 1), -jnp.inf, jnp.float32),
            jnp.zeros((num_tokens, num_heads, 1), jnp.float32),
            jnp.zeros((num_tokens, num_heads, kv_lora_rank), jnp.float32))
    _, l, acc = lax.fori_loop(0, cdiv(jnp.max(kv_len), bk), step, init)
    out = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
    return out.astype(q.dtype)


def mla_paged_decode_reference(q, k_pages, v_pages, block_tables, seq_lens, *, kv_lora_rank: int, scale: float,
                               pages_per_compute_block: int | None = None, interpret: bool = False,
                               backend: str | None = None):
    """`mla_paged_decode`'s signature over the jnp kernel: q ``[num_seqs, num_heads, W]``, one query
    per sequence at position ``seq_lens[s] - 1`` (a row with seq_len 0 gives zeros).
    ``interpret``, ``backend``: ignored."""
    del interpret, backend
    num_seqs = q.shape[0]
    return mla_paged_attention_reference(q, k_pages, v_pages, block_tables, seq_lens,
                                         jnp.arange(num_seqs + 1, dtype=jnp.int32), num_seqs,
                                         kv_lora_rank=kv_lora_rank, scale=scale,
                                         pages_per_compute_block=pages_per_compute_block)
