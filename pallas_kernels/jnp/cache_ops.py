"""jnp KV-pool updates: the ``xla`` backend of ``write_kv`` and ``copy_blocks``.

Cache updates are XLA scatters; padding entries (negative ids) are dropped by pointing them out of
bounds with ``mode="drop"``. Slot ``= block_id * block_size + offset``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import pool, quant


def write_slots(pools, rows, slot_mapping):
    """Writes ``rows`` into the slots of ``pools`` (`quant.pools_and_rows`'s pair); negative
    slots are skipped.

    Args:
      pools: ``(k_pages, v_pages)`` ``[num_kv_heads, num_blocks, block_size, head_dim]``, then
        with 8-bit pages ``kv_scales``.
      rows: ``[num_tokens, num_kv_heads, head_dim]`` for each page array, then the scale words
        ``[num_tokens, num_kv_heads]``.
      slot_mapping: int32 ``[num_tokens]``.

    Returns:
      The updated pools.
    """
    kvh, num_blocks, bs = pools[0].shape[:3]
    num_slots = num_blocks * bs
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)  # OOB: dropped

    def write(pages, new):
        flat = pages.reshape(kvh, num_slots, *pages.shape[3:])
        new = jnp.swapaxes(new, 0, 1).astype(pages.dtype)
        return flat.at[:, slots].set(new, mode="drop").reshape(pages.shape)

    out = tuple(map(write, pools[:2], rows[:2]))
    if len(pools) > 2:
        kv_scales = pools[2]
        row = jnp.where(slot_mapping >= 0, slot_mapping // quant.LANES, kv_scales.shape[1])
        out += (kv_scales.at[:, row, slot_mapping % quant.LANES].set(
            rows[2].T.astype(kv_scales.dtype), mode="drop"),)
    return out


def write_kv_reference(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    *,
    kv_scales: jax.Array | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Writes new K/V rows into their slots; negative slots are skipped.

    Args:
      k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
      k_new, v_new: ``[num_tokens, num_kv_heads, head_dim]``.
      slot_mapping: int32 ``[num_tokens]``, ``block_id * block_size + offset``
        or negative for padding.
      kv_scales: with 8-bit pages, their scale words (``quant.py``): the rows are quantized
        per (token, head) first (``quant.quantize``).
      backend, interpret: ignored (kernel knobs).

    Returns:
      The updated ``(k_pages, v_pages)``, or ``(k_pages, v_pages, kv_scales)`` with scales.
    """
    del backend, interpret
    pools, rows = quant.pools_and_rows(k_pages, v_pages, k_new, v_new, kv_scales)
    return write_slots(pools, rows, slot_mapping)


def copy_pool_blocks(pools, src, dst):
    """Copies block ``src[i]`` to ``dst[i]`` in every array of ``pools`` (pages, then 8-bit
    pages' scale words); pairs with a negative id are skipped."""
    ok = (src >= 0) & (dst >= 0)
    src = jnp.where(ok, src, 0)
    blocked = pool.take_blocks(pools, src)
    return pool.put_blocks(pools, jnp.where(ok, dst, -1), blocked)


def copy_blocks_reference(
    k_pages: jax.Array,
    v_pages: jax.Array,
    src: jax.Array,
    dst: jax.Array,
    *,
    kv_scales: jax.Array | None = None,
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
      kv_scales: the scale words of 8-bit pages (``quant.py``), else None.
      backend, interpret: ignored (kernel knobs).

    Returns:
      The updated ``(k_pages, v_pages)`` (and scales, when given).
    """
    del backend, interpret
    return copy_pool_blocks(quant.pools_of(k_pages, v_pages, kv_scales), src, dst)
