"""jnp KV-pool updates: the ``xla`` backend of ``write_kv`` and ``copy_blocks``.

Cache updates are XLA scatters; padding entries (negative ids) are dropped by pointing them out of
bounds with ``mode="drop"``. Slot ``= block_id * block_size + offset``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jpaged_kernels import quant



def write_slots(pools, rows, slot_mapping):
    """Writes ``rows[i] [num_tokens, num_kv_heads, ...]`` into the slots of
    ``pools[i] [num_kv_heads, num_blocks, block_size, ...]``; negative slots are
    skipped."""
    kvh, num_blocks, bs = pools[0].shape[:3]
    num_slots = num_blocks * bs
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)  # OOB: dropped

    def write(pages, new):
        flat = pages.reshape(kvh, num_slots, *pages.shape[3:])
        new = jnp.swapaxes(new, 0, 1).astype(pages.dtype)
        return flat.at[:, slots].set(new, mode="drop").reshape(pages.shape)

    return tuple(map(write, pools, rows))


def write_kv_reference(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Writes new K/V rows into their slots; negative slots are skipped.

    Args:
      k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
      k_new, v_new: ``[num_tokens, num_kv_heads, head_dim]``.
      slot_mapping: int32 ``[num_tokens]``, ``block_id * block_size + offset``
        or negative for padding.
      k_scales, v_scales: with 8-bit pages, their ``[num_kv_heads, num_blocks,
        block_size]`` scales: the rows are quantized per (token, head) first
        (``quant.quantize``).
      backend, interpret: ignored (kernel knobs).

    Returns:
      The updated ``(k_pages, v_pages)``, or ``(k_pages, v_pages, k_scales,
      v_scales)`` with scales.
    """
    del backend, interpret
    pools, rows = quant.pools_and_rows(k_pages, v_pages, k_new, v_new, k_scales,
                                       v_scales)
    return write_slots(pools, rows, slot_mapping)


def copy_pool_blocks(pools, src, dst):
    """Copies block ``src[i]`` to ``dst[i]`` in every array of ``pools`` (each
    ``[num_kv_heads, num_blocks, ...]``); pairs with a negative id are skipped."""
    num_blocks = pools[0].shape[1]
    ok = (src >= 0) & (dst >= 0)
    src = jnp.where(ok, src, 0)
    dst = jnp.where(ok, dst, num_blocks)  # out of bounds: dropped
    return tuple(pages.at[:, dst].set(pages[:, src], mode="drop")
                 for pages in pools)


def copy_blocks_reference(
    k_pages: jax.Array,
    v_pages: jax.Array,
    src: jax.Array,
    dst: jax.Array,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Copies block ``src[i]`` to ``dst[i]`` in every head of K and V (and of
    their scales, when given).

    Pairs with a negative id are padding and skipped. Destinations must be
    distinct and must not be sources of other pairs.

    Args:
      k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
      src, dst: int32 ``[num_copies]``.
      k_scales, v_scales: ``[num_kv_heads, num_blocks, block_size]`` with 8-bit
        pages, else None.
      backend, interpret: ignored (kernel knobs).

    Returns:
      The updated ``(k_pages, v_pages)`` (and scales, when given).
    """
    del backend, interpret
    return copy_pool_blocks(quant.pools_of(k_pages, v_pages, k_scales, v_scales),
                            src, dst)
