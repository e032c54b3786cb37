"""KV-pool updates: write new K/V into slots, and batched block copies.

Pool layout: ``k_pages``/``v_pages`` are ``[num_kv_heads, num_blocks,
block_size, head_dim]``; slot ``= block_id * block_size + offset``. With
int8/float8_e4m3fn pages the pool also has ``kv_scales`` (uint32 ``[num_kv_heads,
scale_rows, 128]``, one word per slot, ``quant.py``): ``write_kv`` quantizes each
new row per (token, head) and writes values and scale word; ``copy_blocks``
moves the words with their blocks.

Both ops alias the pools to their outputs (``input_output_aliases``), so
inside a jitted step that donates the pool (``donate_argnums``) they update it
in place; without donation XLA inserts one copy of the pool.

Backends (``backend=``, same rules as ``paged_attention.py``):
  * ``"tpu"``: Mosaic (``tpu_cache_ops.py``). ``write_kv`` sorts the write by
    slot and read-modify-writes each touched tile of rows (and 128-word row of
    scale words) once, with double-buffered DMAs: a TPU DMA moves whole tiles
    of 16- and 8-bit arrays, so a single row of a bfloat16 or int8 page cannot
    be written alone. ``copy_blocks`` moves each block of every head with one
    strided HBM->HBM DMA, all in flight together.
  * ``"gpu"``: Triton. ``write_kv``: grid ``(num_tokens, num_kv_heads)``; each
    program stores one ``[head_dim]`` row (and scale word) through the aliased
    pool, skipping negative slots. ``copy_blocks``: grid ``(num_copies,
    num_kv_heads, chunks)``; each program copies ``block_size / chunks`` rows
    of a block (chunks keep a program's tile in registers).
    ``head_dim`` and ``block_size`` must be powers of two.
  * ``"xla"``: scatter (``jnp/cache_ops.py``); the auto choice on CPU/ROCm.

Duplicate slots in one ``write_kv`` call, or a ``copy_blocks`` destination
that is also a source, have no defined winner.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels import quant
from pallas_kernels.jnp import cache_ops as jnp_cache_ops
from pallas_kernels.pallas.common import dispatch, gpu_call
from pallas_kernels.pallas.tpu_cache_ops import copy_blocks_tpu, write_kv_tpu
from pallas_kernels.shapes import check_pools, is_power_of_2

# Elements of a page a Triton copy program moves: 16 KiB of float32 over 4 warps.
_GPU_COPY_ELEMENTS = 4096


def _gpu_ok(k_pages):
    return is_power_of_2(k_pages.shape[-1]) and is_power_of_2(k_pages.shape[2])


def _pool_shapes(pools):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools]


def _gpu_views(pools):
    """Pages as they are, scale words as ``[num_kv_heads, blocks, block_size]`` (free reshapes
    on GPU) and a function that turns the views back."""
    block_size = pools[0].shape[2]
    views = [x if i < 2 else quant.block_words(x, block_size) for i, x in enumerate(pools)]
    return views, lambda outs: tuple(o.reshape(x.shape) for o, x in zip(outs, pools))


# ---------------------------------------------------------------------------
# write_kv
# ---------------------------------------------------------------------------


def _write_kv_gpu_kernel(slot_ref, *refs):
    # refs: n rows of (token t, head h) ([head_dim], or [1] for a scale word), n
    # pools (aliased, unused), n output pools (whole).
    n = len(refs) // 3
    rows, outs = refs[:n], refs[2 * n:]
    t, h = pl.program_id(0), pl.program_id(1)
    block_size = outs[0].shape[2]
    slot = slot_ref[t]

    @pl.when(slot >= 0)
    def _():
        block, offset = lax.div(slot, block_size), lax.rem(slot, block_size)
        for row, out in zip(rows, outs):
            if out.ndim == 4:
                out[h, block, offset, :] = row[...]
            else:  # scale words: [num_kv_heads, blocks, block_size]
                out[h, block, pl.ds(offset, 1)] = row[...]


def _write_kv_gpu(slot_mapping, *arrays, interpret):
    n = len(arrays) // 2
    pools, rows = arrays[:n], arrays[n:]
    views, unview = _gpu_views(pools)
    num_tokens, num_kv_heads = rows[0].shape[:2]
    # Scale words get a trailing axis of 1 (Triton blocks are never 0-d).
    rows = [(r if r.ndim == 3 else r[..., None]).astype(x.dtype)
            for r, x in zip(rows, views)]
    row_specs = [pl.BlockSpec((None, None, r.shape[-1]), lambda t, h: (t, h, 0))
                 for r in rows]
    pool_specs = [pl.BlockSpec(x.shape, lambda t, h, nd=x.ndim: (0,) * nd)
                  for x in views]
    out = gpu_call(
        _write_kv_gpu_kernel, grid=(num_tokens, num_kv_heads),
        in_specs=[pl.BlockSpec(slot_mapping.shape, lambda t, h: (0,)),
                  *row_specs, *pool_specs],
        out_specs=pool_specs, out_shape=_pool_shapes(views),
        num_warps=1, num_stages=1,
        aliases={1 + n + i: i for i in range(n)},
        interpret=interpret, name="write_kv_gpu",
    )(slot_mapping.astype(jnp.int32), *rows, *views)
    return unview(out)


def _write_kv_xla(slot_mapping, *arrays):
    n = len(arrays) // 2
    return jnp_cache_ops.write_slots(arrays[:n], arrays[n:], slot_mapping)


@functools.partial(jax.jit, static_argnames=["backend", "interpret"])
def write_kv(
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
    """Writes each new token's K/V (all heads) into its pool slot.

    Args:
      k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
      k_new, v_new: ``[num_tokens, num_kv_heads, head_dim]`` (cast to the pool
        dtype).
      slot_mapping: int32 ``[num_tokens]``; negative slots are padding and
        skipped.
      kv_scales: with int8/float8_e4m3fn pages, their scale words (``quant.py``);
        each new row is quantized with its own scale (``quant.quantize``) and
        both are written.
      backend: ``None``/``"auto"``, ``"tpu"``, ``"gpu"`` or ``"xla"``.
      interpret: run the Pallas kernel in interpret mode (any host).

    Returns:
      The updated ``(k_pages, v_pages)`` (then ``kv_scales`` when given),
      aliasing the inputs.
    """
    check_pools(k_pages, v_pages)
    num_kv_heads, _, _, head_dim = k_pages.shape
    if (k_new.shape != v_new.shape or k_new.ndim != 3
        or k_new.shape[1:] != (num_kv_heads, head_dim)
            or slot_mapping.shape != k_new.shape[:1]):
        raise ValueError("k_new/v_new must be [num_tokens, num_kv_heads, "
                         "head_dim] and slot_mapping [num_tokens]; got "
                         f"{k_new.shape}, {v_new.shape}, {slot_mapping.shape}")
    pools, rows = quant.pools_and_rows(k_pages, v_pages, k_new, v_new, kv_scales)
    impl = dispatch(backend, interpret, tpu=write_kv_tpu,
                    gpu=_write_kv_gpu if _gpu_ok(k_pages) else None,
                    xla=_write_kv_xla)
    return tuple(impl(slot_mapping, *pools, *rows))


# ---------------------------------------------------------------------------
# copy_blocks
# ---------------------------------------------------------------------------


def _copy_blocks_gpu_kernel(src_ref, dst_ref, *refs):
    outs = refs[len(refs) // 2:]
    i, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    src, dst = src_ref[i], dst_ref[i]
    rows = outs[0].shape[2] // pl.num_programs(2)

    @pl.when((src >= 0) & (dst >= 0))
    def _():
        for pages in outs:
            part = pl.ds(c * rows, rows)
            pages[h, dst, part] = pages[h, src, part]


def _copy_blocks_gpu(src, dst, *pools, interpret):
    n = len(pools)
    views, unview = _gpu_views(pools)
    num_kv_heads, _, block_size, head_dim = pools[0].shape
    chunks = max(1, block_size * head_dim // _GPU_COPY_ELEMENTS)
    ids_spec = pl.BlockSpec(src.shape, lambda i, h, c: (0,))
    pool_specs = [pl.BlockSpec(x.shape, lambda i, h, c, nd=x.ndim: (0,) * nd)
                  for x in views]
    out = gpu_call(
        _copy_blocks_gpu_kernel, grid=(src.shape[0], num_kv_heads, chunks),
        in_specs=[ids_spec, ids_spec, *pool_specs],
        out_specs=pool_specs, out_shape=_pool_shapes(views),
        num_warps=4, num_stages=1, aliases={2 + i: i for i in range(n)},
        interpret=interpret, name="copy_blocks_gpu",
    )(src.astype(jnp.int32), dst.astype(jnp.int32), *views)
    return unview(out)


def _copy_blocks_xla(src, dst, *pools):
    return jnp_cache_ops.copy_pool_blocks(pools, src, dst)


@functools.partial(jax.jit, static_argnames=["backend", "interpret"])
def copy_blocks(
    k_pages: jax.Array,
    v_pages: jax.Array,
    src: jax.Array,
    dst: jax.Array,
    *,
    kv_scales: jax.Array | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Copies block ``src[i]`` to block ``dst[i]`` in every head of K and V
    (and their scale words, with 8-bit pages).

    Used for copy-on-write of shared blocks and for swap-in; one call carries
    all copies of a step.

    Args:
      k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
      src, dst: int32 ``[num_copies]`` block ids; a pair with a negative id is
        padding and skipped. Destinations must be distinct and not sources.
      kv_scales: the scale words of int8/float8_e4m3fn pages (``quant.py``),
        else None.
      backend: ``None``/``"auto"``, ``"tpu"``, ``"gpu"`` or ``"xla"``.
      interpret: run the Pallas kernel in interpret mode (any host).

    Returns:
      The updated ``(k_pages, v_pages)`` (then ``kv_scales``, when given),
      aliasing the inputs.
    """
    check_pools(k_pages, v_pages)
    pools = quant.pools_of(k_pages, v_pages, kv_scales)
    if src.ndim != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must both be [num_copies]; got {src.shape} "
                         f"and {dst.shape}")
    if src.shape[0] == 0:
        return pools
    impl = dispatch(backend, interpret, tpu=copy_blocks_tpu,
                    gpu=_copy_blocks_gpu if _gpu_ok(k_pages) else None,
                    xla=_copy_blocks_xla)
    return tuple(impl(src, dst, *pools))
