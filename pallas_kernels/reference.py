"""Pure-jnp references for the kernels in this package.

Every function here has the same signature as its kernel (the kernel's tuning
knobs are accepted and ignored), so tests and callers can swap one for the
other. They are also the XLA path ("attention_backend='xla'") used on CPU:

* Attention gathers one sequence's (or one query token's) pages at a time and
  maps over sequences/tokens in chunks with ``lax.map(..., batch_size=...)``,
  so peak memory stays bounded (about ``_GATHER_BUDGET`` elements) instead of
  materializing K/V for the whole batch.
* Cache updates are XLA scatters; padding entries (negative ids) are dropped
  by pointing them out of bounds with ``mode="drop"``.

Layout (shared with the kernels):
  k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
  slot = ``block_id * block_size + offset``.
  block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
  Query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

# Max elements of gathered K (or V) held at once by the chunked references.
_GATHER_BUDGET = 1 << 24


def _chunk(num_items: int, per_item: int) -> int:
  return max(1, min(num_items, _GATHER_BUDGET // max(per_item, 1)))


def _gather_context(pages: jax.Array, block_table: jax.Array) -> jax.Array:
  """[kvh, num_blocks, bs, d], [max_blocks] -> [kvh, max_blocks * bs, d]."""
  kvh, _, bs, d = pages.shape
  return pages[:, block_table].reshape(kvh, block_table.shape[0] * bs, d)


def _attend(q, k, v, q_positions, seq_len, scale):
  """Causal attention of a few query rows over one sequence's context.

  Args:
    q: ``[n, num_q_heads, d]``.
    k, v: ``[num_kv_heads, ctx, d]`` (the sequence's gathered pages).
    q_positions: int32 ``[n]``, absolute position of each query row.
    seq_len: number of valid context tokens.
    scale: softmax scale.

  Returns:
    ``[n, num_q_heads, d]`` float32; rows with no visible key are zeros.
  """
  n, hq, d = q.shape
  kvh, ctx, _ = k.shape
  qg = q.reshape(n, kvh, hq // kvh, d).astype(jnp.float32)
  logits = jnp.einsum("nkgd,ktd->nkgt", qg, k.astype(jnp.float32)) * scale
  key_pos = jnp.arange(ctx, dtype=jnp.int32)
  mask = ((key_pos[None, :] <= q_positions[:, None])
          & (key_pos[None, :] < seq_len))
  mask = mask[:, None, None, :]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  v32 = jnp.where(key_pos[None, :, None] < seq_len, v.astype(jnp.float32), 0.0)
  out = jnp.einsum("nkgt,ktd->nkgd", p, v32)
  out = jnp.where(l > 0, out / jnp.where(l > 0, l, 1.0), 0.0)
  return out.reshape(n, hq, d)


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    pages_per_compute_block: int | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
  """Decode attention reference: one query token per sequence.

  Args:
    q: ``[num_seqs, num_q_heads, head_dim]``.
    k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
    seq_lens: int32 ``[num_seqs]``; query ``s`` attends to positions
      ``0 .. seq_lens[s] - 1``. Zero gives a zero output row.
    scale: softmax scale applied to ``q @ k``.
    pages_per_compute_block, backend, interpret: ignored (kernel knobs).

  Returns:
    ``[num_seqs, num_q_heads, head_dim]`` in ``q.dtype``.
  """
  del pages_per_compute_block, backend, interpret
  num_kv_heads, _, block_size, head_dim = k_pages.shape
  ctx = block_tables.shape[1] * block_size

  def one(args):
    q_s, table, seq_len = args
    k = _gather_context(k_pages, table)
    v = _gather_context(v_pages, table)
    pos = (seq_len - 1)[None]
    return _attend(q_s[None], k, v, pos, seq_len, scale)[0]

  out = lax.map(one, (q, block_tables, seq_lens.astype(jnp.int32)),
                batch_size=_chunk(q.shape[0], ctx * num_kv_heads * head_dim))
  return out.astype(q.dtype)


def token_metadata(query_start_loc, num_seqs, num_tokens):
  """Sequence id and validity of every flat query row.

  Args:
    query_start_loc: int32 ``[max_seqs + 1]``.
    num_seqs: int32 scalar or ``[1]``; sequences at/after it are padding.
    num_tokens: static number of query rows.

  Returns:
    ``(seq_ids, valid)``: int32 ``[num_tokens]`` (clamped to a real index) and
    bool ``[num_tokens]`` (False for rows at/after
    ``query_start_loc[num_seqs]``).
  """
  num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
  max_seqs = query_start_loc.shape[0] - 1
  rows = jnp.arange(num_tokens, dtype=jnp.int32)
  ends = query_start_loc[1:]
  real = jnp.arange(max_seqs) < num_seqs
  # Number of real sequences that end at or before each row.
  seq_ids = jnp.sum(real[None, :] & (ends[None, :] <= rows[:, None]), axis=1)
  valid = rows < query_start_loc[num_seqs]
  return jnp.minimum(seq_ids, max_seqs - 1).astype(jnp.int32), valid


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    scale: float,
    num_queries_per_block: int | None = None,
    pages_per_compute_block: int | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
  """Mixed prefill + decode attention reference over a flat batch of tokens.

  Args:
    q: ``[num_tokens, num_q_heads, head_dim]``; rows
      ``query_start_loc[s]:query_start_loc[s + 1]`` belong to sequence ``s``.
    k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``,
      already holding the new tokens' K/V.
    block_tables: int32 ``[max_seqs, max_blocks_per_seq]``.
    seq_lens: int32 ``[max_seqs]``, context length including the new tokens.
    query_start_loc: int32 ``[max_seqs + 1]``.
    num_seqs: int32 scalar or ``[1]``.
    scale: softmax scale.
    num_queries_per_block, pages_per_compute_block, backend, interpret:
      ignored (kernel knobs).

  Returns:
    ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``; row ``i`` of
    sequence ``s`` sits at position ``seq_lens[s] - q_len + i`` and attends
    causally; padding rows are zeros.
  """
  del num_queries_per_block, pages_per_compute_block, backend, interpret
  num_tokens = q.shape[0]
  num_kv_heads, _, block_size, head_dim = k_pages.shape
  ctx = block_tables.shape[1] * block_size
  seq_ids, valid = token_metadata(query_start_loc, num_seqs, num_tokens)
  seq_lens = seq_lens.astype(jnp.int32)
  q_lens = query_start_loc[1:] - query_start_loc[:-1]
  rows = jnp.arange(num_tokens, dtype=jnp.int32)
  positions = (seq_lens[seq_ids] - q_lens[seq_ids]
               + rows - query_start_loc[seq_ids])

  def one(args):
    q_t, seq_id, pos, ok = args
    k = _gather_context(k_pages, block_tables[seq_id])
    v = _gather_context(v_pages, block_tables[seq_id])
    seq_len = jnp.where(ok, seq_lens[seq_id], 0)
    return _attend(q_t[None], k, v, pos[None], seq_len, scale)[0]

  out = lax.map(one, (q, seq_ids, positions, valid),
                batch_size=_chunk(num_tokens, ctx * num_kv_heads * head_dim))
  return out.astype(q.dtype)


def write_kv_reference(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    *,
    backend: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Writes new K/V rows into their slots; negative slots are skipped.

  Args:
    k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    k_new, v_new: ``[num_tokens, num_kv_heads, head_dim]``.
    slot_mapping: int32 ``[num_tokens]``, ``block_id * block_size + offset``
      or negative for padding.
    backend, interpret: ignored (kernel knobs).

  Returns:
    The updated ``(k_pages, v_pages)``.
  """
  del backend, interpret
  kvh, num_blocks, bs, d = k_pages.shape
  num_slots = num_blocks * bs
  slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)  # OOB: dropped

  def write(pages, new):
    flat = pages.reshape(kvh, num_slots, d)
    new = jnp.swapaxes(new, 0, 1).astype(pages.dtype)
    return flat.at[:, slots].set(new, mode="drop").reshape(pages.shape)

  return write(k_pages, k_new), write(v_pages, v_new)


def copy_blocks_reference(
    k_pages: jax.Array,
    v_pages: jax.Array,
    src: jax.Array,
    dst: jax.Array,
    *,
    backend: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Copies block ``src[i]`` to ``dst[i]`` in every head of K and V.

  Pairs with a negative id are padding and skipped. Destinations must be
  distinct and must not be sources of other pairs.

  Args:
    k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    src, dst: int32 ``[num_copies]``.
    backend, interpret: ignored (kernel knobs).

  Returns:
    The updated ``(k_pages, v_pages)``.
  """
  del backend, interpret
  num_blocks = k_pages.shape[1]
  ok = (src >= 0) & (dst >= 0)
  src = jnp.where(ok, src, 0)
  dst = jnp.where(ok, dst, num_blocks)  # out of bounds: dropped

  def copy(pages):
    return pages.at[:, dst].set(pages[:, src], mode="drop")

  return copy(k_pages), copy(v_pages)
