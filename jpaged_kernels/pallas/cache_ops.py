"""KV-pool updates: write new K/V into slots, and batched block copies.

Pool layout: ``k_pages``/``v_pages`` are ``[num_kv_heads, num_blocks,
block_size, head_dim]``; slot ``= block_id * block_size + offset``. With
int8/float8_e4m3fn pages the pool also has ``k_scales``/``v_scales``
``[num_kv_heads, num_blocks, block_size]`` (``quant.py``): ``write_kv``
quantizes each new row per (token, head) and writes values and scale;
``copy_blocks`` moves scales with their blocks. Both kernels handle any number
of pool arrays that lead with ``[num_kv_heads, num_blocks, block_size]``.

Both ops alias the pools to their outputs (``input_output_aliases``), so
inside a jitted step that donates the pool (``donate_argnums``) they update it
in place; without donation XLA inserts one copy of the pool.

Backends (``backend=``, same rules as ``paged_attention.py``):
  * ``"tpu"``: Mosaic. All operands stay in HBM (``pl.ANY``); the slot ids
    (or block ids) are scalar-prefetch operands, and each token's row of
    every head (or each block of every head) of every pool array is moved
    with one strided HBM->HBM DMA. All DMAs are started, then all are waited
    on, so they overlap; entries with a negative id start no DMA.
  * ``"gpu"``: Triton. Grid ``(num_tokens | num_copies, num_kv_heads)``; each
    program loads one ``[head_dim]`` row (or ``[block_size, head_dim]`` block)
    and stores it through the aliased pool, skipping negative ids.
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
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from jpaged_kernels import quant
from jpaged_kernels.jnp import cache_ops as jnp_cache_ops
from jpaged_kernels.pallas.common import dispatch, gpu_call, tpu_call
from jpaged_kernels.shapes import check_pools, is_power_of_2


def _gpu_ok(k_pages):
    return is_power_of_2(k_pages.shape[-1]) and is_power_of_2(k_pages.shape[2])


# ---------------------------------------------------------------------------
# write_kv
# ---------------------------------------------------------------------------


def _pool_shapes(pools):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools]


def _write_kv_tpu_kernel(slot_ref, *refs):
    # refs: n rows [num_kv_heads, num_tokens, ...] (HBM), n pools (aliased to
    # the outputs, unused), n output pools, the DMA semaphore.
    n = (len(refs) - 1) // 3
    rows, outs, sem = refs[:n], refs[2 * n:3 * n], refs[-1]
    num_tokens = rows[0].shape[1]
    block_size = outs[0].shape[2]

    def copies(t):
        slot = slot_ref[t]
        block, offset = lax.div(slot, block_size), lax.rem(slot, block_size)
        return slot >= 0, [
            pltpu.make_async_copy(src.at[:, pl.ds(t, 1)],
                                  dst.at[:, block, pl.ds(offset, 1)], sem)
            for src, dst in zip(rows, outs)]

    def run(method):
        def body(t, carry):
            valid, group = copies(t)

            @pl.when(valid)
            def _():
                for c in group:
                    getattr(c, method)()
            return carry
        lax.fori_loop(0, num_tokens, body, 0)

    run("start")
    run("wait")


def _write_kv_tpu(slot_mapping, *arrays, interpret):
    n = len(arrays) // 2
    pools, rows = arrays[:n], arrays[n:]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return tpu_call(
        _write_kv_tpu_kernel, grid=(1,), num_scalar_prefetch=1,
        in_specs=[any_spec] * (2 * n), out_specs=[any_spec] * n,
        out_shape=_pool_shapes(pools),
        scratch_shapes=[pltpu.SemaphoreType.DMA(())], parallel=False,
        # Operand indices count the scalar-prefetch operand.
        aliases={1 + n + i: i for i in range(n)}, interpret=interpret,
        name="write_kv_tpu",
    )(slot_mapping.astype(jnp.int32),
      *[jnp.swapaxes(r, 0, 1).astype(x.dtype) for r, x in zip(rows, pools)],
      *pools)


def _write_kv_gpu_kernel(slot_ref, *refs):
    # refs: n rows of (token t, head h) ([head_dim], or [1] for a scale), n
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
            else:  # a scale: [num_kv_heads, num_blocks, block_size]
                out[h, block, pl.ds(offset, 1)] = row[...]


def _write_kv_gpu(slot_mapping, *arrays, interpret):
    n = len(arrays) // 2
    pools, rows = arrays[:n], arrays[n:]
    num_tokens, num_kv_heads = rows[0].shape[:2]
    # Scale rows get a trailing axis of 1 (Triton blocks are never 0-d).
    rows = [(r if r.ndim == 3 else r[..., None]).astype(x.dtype)
            for r, x in zip(rows, pools)]
    row_specs = [pl.BlockSpec((None, None, r.shape[-1]), lambda t, h: (t, h, 0))
                 for r in rows]
    pool_specs = [pl.BlockSpec(x.shape, lambda t, h, nd=x.ndim: (0,) * nd)
                  for x in pools]
    return gpu_call(
        _write_kv_gpu_kernel, grid=(num_tokens, num_kv_heads),
        in_specs=[pl.BlockSpec(slot_mapping.shape, lambda t, h: (0,)),
                  *row_specs, *pool_specs],
        out_specs=pool_specs, out_shape=_pool_shapes(pools),
        num_warps=1, num_stages=1,
        aliases={1 + n + i: i for i in range(n)},
        interpret=interpret, name="write_kv_gpu",
    )(slot_mapping.astype(jnp.int32), *rows, *pools)


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
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
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
      k_scales, v_scales: with int8/float8_e4m3fn pages, their ``[num_kv_heads,
        num_blocks, block_size]`` scales; each new row is quantized with its
        own scale (``quant.quantize``) and both are written.
      backend: ``None``/``"auto"``, ``"tpu"``, ``"gpu"`` or ``"xla"``.
      interpret: run the Pallas kernel in interpret mode (any host).

    Returns:
      The updated ``(k_pages, v_pages)`` (then ``k_scales, v_scales`` when
      given), aliasing the inputs.
    """
    check_pools(k_pages, v_pages)
    num_kv_heads, _, _, head_dim = k_pages.shape
    if (k_new.shape != v_new.shape or k_new.ndim != 3
        or k_new.shape[1:] != (num_kv_heads, head_dim)
            or slot_mapping.shape != k_new.shape[:1]):
        raise ValueError("k_new/v_new must be [num_tokens, num_kv_heads, "
                         "head_dim] and slot_mapping [num_tokens]; got "
                         f"{k_new.shape}, {v_new.shape}, {slot_mapping.shape}")
    pools, rows = quant.pools_and_rows(k_pages, v_pages, k_new, v_new, k_scales,
                                       v_scales)
    impl = dispatch(backend, interpret, tpu=_write_kv_tpu,
                    gpu=_write_kv_gpu if _gpu_ok(k_pages) else None,
                    xla=_write_kv_xla)
    return tuple(impl(slot_mapping, *pools, *rows))


# ---------------------------------------------------------------------------
# copy_blocks
# ---------------------------------------------------------------------------


def _copy_blocks_tpu_kernel(src_ref, dst_ref, *refs):
    # refs: n pools (aliased, unused), n output pools, the DMA semaphore.
    n = (len(refs) - 1) // 2
    outs, sem = refs[n:2 * n], refs[-1]
    num_copies = src_ref.shape[0]

    def run(method):
        def body(i, carry):
            src, dst = src_ref[i], dst_ref[i]

            @pl.when((src >= 0) & (dst >= 0))
            def _():
                for pages in outs:
                    copy = pltpu.make_async_copy(pages.at[:, src], pages.at[:, dst], sem)
                    getattr(copy, method)()
            return carry
        lax.fori_loop(0, num_copies, body, 0)

    run("start")
    run("wait")


def _copy_blocks_tpu(src, dst, *pools, interpret):
    n = len(pools)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return tpu_call(
        _copy_blocks_tpu_kernel, grid=(1,), num_scalar_prefetch=2,
        in_specs=[any_spec] * n, out_specs=[any_spec] * n,
        out_shape=_pool_shapes(pools),
        scratch_shapes=[pltpu.SemaphoreType.DMA(())], parallel=False,
        aliases={2 + i: i for i in range(n)}, interpret=interpret,
        name="copy_blocks_tpu",
    )(src.astype(jnp.int32), dst.astype(jnp.int32), *pools)


def _copy_blocks_gpu_kernel(src_ref, dst_ref, *refs):
    outs = refs[len(refs) // 2:]
    i, h = pl.program_id(0), pl.program_id(1)
    src, dst = src_ref[i], dst_ref[i]

    @pl.when((src >= 0) & (dst >= 0))
    def _():
        for pages in outs:
            pages[h, dst] = pages[h, src]


def _copy_blocks_gpu(src, dst, *pools, interpret):
    n = len(pools)
    num_kv_heads = pools[0].shape[0]
    ids_spec = pl.BlockSpec(src.shape, lambda i, h: (0,))
    pool_specs = [pl.BlockSpec(x.shape, lambda i, h, nd=x.ndim: (0,) * nd)
                  for x in pools]
    return gpu_call(
        _copy_blocks_gpu_kernel, grid=(src.shape[0], num_kv_heads),
        in_specs=[ids_spec, ids_spec, *pool_specs],
        out_specs=pool_specs, out_shape=_pool_shapes(pools),
        num_warps=4, num_stages=1, aliases={2 + i: i for i in range(n)},
        interpret=interpret, name="copy_blocks_gpu",
    )(src.astype(jnp.int32), dst.astype(jnp.int32), *pools)


def _copy_blocks_xla(src, dst, *pools):
    return jnp_cache_ops.copy_pool_blocks(pools, src, dst)


@functools.partial(jax.jit, static_argnames=["backend", "interpret"])
def copy_blocks(
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
    """Copies block ``src[i]`` to block ``dst[i]`` in every head of K and V
    (and of their scales, with 8-bit pages).

    Used for copy-on-write of shared blocks and for swap-in; one call carries
    all copies of a step.

    Args:
      k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
      src, dst: int32 ``[num_copies]`` block ids; a pair with a negative id is
        padding and skipped. Destinations must be distinct and not sources.
      k_scales, v_scales: ``[num_kv_heads, num_blocks, block_size]`` with
        int8/float8_e4m3fn pages, else None.
      backend: ``None``/``"auto"``, ``"tpu"``, ``"gpu"`` or ``"xla"``.
      interpret: run the Pallas kernel in interpret mode (any host).

    Returns:
      The updated ``(k_pages, v_pages)`` (then the scales, when given),
      aliasing the inputs.
    """
    check_pools(k_pages, v_pages)
    pools = quant.pools_of(k_pages, v_pages, k_scales, v_scales)
    if src.ndim != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must both be [num_copies]; got {src.shape} "
                         f"and {dst.shape}")
    if src.shape[0] == 0:
        return pools
    impl = dispatch(backend, interpret, tpu=_copy_blocks_tpu,
                    gpu=_copy_blocks_gpu if _gpu_ok(k_pages) else None,
                    xla=_copy_blocks_xla)
    return tuple(impl(src, dst, *pools))
