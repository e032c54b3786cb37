"""Paged attention as a layer: write this step's K/V into the block pool, then attend through it.

`AttentionMetadata` is the per-step batch description every layer shares (built on the host by the
model runner). `PagedAttention` is an NNX module without parameters that a Flax model calls in
place of dense attention; researchers can import it into their own decoder blocks.

KV pool layout, per layer: ``k_pages`` and ``v_pages`` of shape
``[num_kv_heads, num_blocks, block_size, head_dim]``; slot ``s`` is block ``s // block_size``,
offset ``s % block_size``. Heads lead so the pool shards on its first axis.

Backends:
- ``xla``: plain jnp gathers through the block tables (the CPU default). Query tokens are grouped
  into chunks of one sequence each: decode rows in chunks of 1, prompt chunks in chunks of
  ``PREFILL_CHUNK`` tokens, so a chunk gathers its sequence's keys once and no decode row is padded
  to a long prompt's length.
- ``pallas``: the Pallas kernels of `pallas_kernels` over the flat token batch (TPU/GPU; interpret
  mode elsewhere).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from jpaged import sharding

PREFILL_CHUNK = 16


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                                "num_seqs", "positions", "chunk_groups", "token_to_row"],
                   meta_fields=[])
@dataclasses.dataclass
class AttentionMetadata:
    """Per-step arrays (all int32). T = padded token count, S = padded sequence count.

    slot_mapping[T]: pool slot each token's K/V is written to (-1 for padding).
    block_tables[S, max_blocks], seq_lens[S] (context incl. this step's tokens),
    query_start_loc[S+1], num_seqs[]: the ragged layout the Pallas kernel reads.
    positions[T]: each token's position in its sequence.
    chunk_groups: for the xla backend, a tuple of (chunk_seq[C], chunk_rows[C, Q]) per chunk width Q;
      chunk_rows index the flat tokens (T marks padding).
    token_to_row[T]: row of each token in the concatenation of all groups' chunk rows.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    num_seqs: jax.Array
    positions: jax.Array
    chunk_groups: tuple
    token_to_row: jax.Array


def xla_paged_attention(q, k_pages, v_pages, md: AttentionMetadata, *, scale):
    """Attention of flat query tokens [T, Hq, D] over their sequences' blocks, in plain jnp."""
    t, hq, d = q.shape
    hkv, _, bs, _ = k_pages.shape
    group = hq // hkv
    q_padded = jnp.concatenate([q, jnp.zeros((1, hq, d), q.dtype)])
    pos_padded = jnp.concatenate([md.positions, jnp.full((1,), -1, md.positions.dtype)])
    outs = []
    for chunk_seq, chunk_rows in md.chunk_groups:
        c, qw = chunk_rows.shape
        if c == 0:
            continue
        tables = md.block_tables[chunk_seq]                                   # [C, B]
        k = k_pages[:, tables].reshape(hkv, c, -1, d)                         # [Hkv, C, K, D]
        v = v_pages[:, tables].reshape(hkv, c, -1, d)
        qc = q_padded[chunk_rows].reshape(c, qw, hkv, group, d)
        s = jnp.einsum("cqhgd,hckd->chgqk", qc, k, preferred_element_type=jnp.float32) * scale
        q_pos = pos_padded[chunk_rows]                                        # [C, Q]
        k_pos = jnp.arange(k.shape[2])
        mask = (k_pos[None, None, :] <= q_pos[:, :, None])[:, None, None]     # [C,1,1,Q,K]
        s = jnp.where(mask, s, -1e30)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("chgqk,hckd->cqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        outs.append(o.reshape(c * qw, hq, d))
    rows = jnp.concatenate(outs) if outs else jnp.zeros((1, hq, d), jnp.float32)
    return rows[md.token_to_row].astype(q.dtype)


def _interpret() -> bool:
    return jax.default_backend() not in ("tpu", "gpu")


def pallas_paged_attention(q, k_pages, v_pages, md: AttentionMetadata, *, scale):
    """The ragged Pallas kernel over the flat token batch (interpret mode off TPU/GPU)."""
    return pallas_kernels.ragged_paged_attention(q, k_pages, v_pages, md.block_tables, md.seq_lens,
                                                 md.query_start_loc, md.num_seqs, scale=scale,
                                                 interpret=_interpret())


def pallas_write_kv(k_pages, v_pages, k_new, v_new, slot_mapping):
    return pallas_kernels.write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, interpret=_interpret())


BACKENDS = {"xla": (pallas_kernels.write_kv_reference, xla_paged_attention),
            "pallas": (pallas_write_kv, pallas_paged_attention)}


class PagedAttention(nnx.Module):
    """Writes K/V for this step's tokens into the paged cache and attends through block tables.

    Call with q [T, Hq, D], k and v [T, Hkv, D], this layer's ``(k_pages, v_pages)`` and the
    step's `AttentionMetadata`; returns the attention output [T, Hq, D] and the updated pages.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, scale: float | None = None,
                 backend: str = "xla"):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r}: expected one of {sorted(BACKENDS)}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.backend = backend

    def __call__(self, q, k, v, kv_cache, md: AttentionMetadata):
        write, attend = BACKENDS[self.backend]

        def write_and_attend(q, k, v, k_pages, v_pages, md):
            k_pages, v_pages = write(k_pages, v_pages, k, v, md.slot_mapping)
            return attend(q, k_pages, v_pages, md, scale=self.scale), k_pages, v_pages

        if sharding.model_axis_size() > 1:  # each device attends with its own heads and pool slice
            write_and_attend = sharding.shard_heads(write_and_attend, num_args_sharded=5)
        out, k_pages, v_pages = write_and_attend(q, k, v, *kv_cache, md)
        return out, (k_pages, v_pages)
