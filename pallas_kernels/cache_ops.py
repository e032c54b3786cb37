"""KV-pool updates: write new K/V into slots, and batched block copies.

Pool layout: ``k_pages``/``v_pages`` are ``[num_kv_heads, num_blocks,
block_size, head_dim]``; slot ``= block_id * block_size + offset``.

Both ops alias the pools to their outputs (``input_output_aliases``), so
inside a jitted step that donates the pool (``donate_argnums``) they update it
in place; without donation XLA inserts one copy of the pool.

Backends (``backend=``, same rules as ``paged_attention.py``):
  * ``"tpu"``: Mosaic. All operands stay in HBM (``pl.ANY``); the slot ids
    (or block ids) are scalar-prefetch operands, and each token's K/V row of
    every head (or each block of every head) is moved with one strided
    HBM->HBM DMA. All DMAs are started, then all are waited on, so they
    overlap; entries with a negative id start no DMA.
  * ``"gpu"``: Triton. Grid ``(num_tokens | num_copies, num_kv_heads)``; each
    program loads one ``[head_dim]`` row (or ``[block_size, head_dim]`` block)
    and stores it through the aliased pool, skipping negative ids.
    ``head_dim`` and ``block_size`` must be powers of two.
  * ``"xla"``: scatter (``reference.py``); the auto choice on CPU/ROCm.

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

from pallas_kernels import reference
from pallas_kernels._common import (
    check_pools, dispatch, gpu_call, is_power_of_2, tpu_call)


def _gpu_ok(k_pages):
  return is_power_of_2(k_pages.shape[-1]) and is_power_of_2(k_pages.shape[2])


# ---------------------------------------------------------------------------
# write_kv
# ---------------------------------------------------------------------------


def _write_kv_tpu_kernel(slot_ref, k_new_hbm, v_new_hbm, _k_in, _v_in,
                         k_out, v_out, sem):
  # k_new_hbm: [num_kv_heads, num_tokens, head_dim]; k_out: the pool.
  num_tokens = k_new_hbm.shape[1]
  block_size = k_out.shape[2]

  def copies(t):
    slot = slot_ref[t]
    block, offset = lax.div(slot, block_size), lax.rem(slot, block_size)
    return slot >= 0, [
        pltpu.make_async_copy(src.at[:, pl.ds(t, 1)],
                              dst.at[:, block, pl.ds(offset, 1)], sem)
        for src, dst in ((k_new_hbm, k_out), (v_new_hbm, v_out))]

  def run(method):
    def body(t, carry):
      valid, pair = copies(t)

      @pl.when(valid)
      def _():
        for c in pair:
          getattr(c, method)()
      return carry
    lax.fori_loop(0, num_tokens, body, 0)

  run("start")
  run("wait")


def _write_kv_tpu(k_pages, v_pages, k_new, v_new, slot_mapping, *, interpret):
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return tpu_call(
      _write_kv_tpu_kernel, grid=(1,), num_scalar_prefetch=1,
      in_specs=[any_spec] * 4, out_specs=[any_spec] * 2,
      out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                 jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
      scratch_shapes=[pltpu.SemaphoreType.DMA(())], parallel=False,
      # Operand indices count the scalar-prefetch operand.
      aliases={3: 0, 4: 1}, interpret=interpret, name="write_kv_tpu",
  )(slot_mapping.astype(jnp.int32),
    jnp.swapaxes(k_new, 0, 1).astype(k_pages.dtype),
    jnp.swapaxes(v_new, 0, 1).astype(v_pages.dtype), k_pages, v_pages)


def _write_kv_gpu_kernel(slot_ref, k_new_ref, v_new_ref, _k_in, _v_in,
                         k_out, v_out):
  # k_new_ref: [head_dim] of (token t, head h); k_out: the whole pool.
  t, h = pl.program_id(0), pl.program_id(1)
  block_size = k_out.shape[2]
  slot = slot_ref[t]

  @pl.when(slot >= 0)
  def _():
    block, offset = lax.div(slot, block_size), lax.rem(slot, block_size)
    k_out[h, block, offset, :] = k_new_ref[...]
    v_out[h, block, offset, :] = v_new_ref[...]


def _write_kv_gpu(k_pages, v_pages, k_new, v_new, slot_mapping, *, interpret):
  num_tokens, num_kv_heads, head_dim = k_new.shape
  row_spec = pl.BlockSpec((None, None, head_dim), lambda t, h: (t, h, 0))
  pool_spec = pl.BlockSpec(k_pages.shape, lambda t, h: (0, 0, 0, 0))
  return gpu_call(
      _write_kv_gpu_kernel, grid=(num_tokens, num_kv_heads),
      in_specs=[pl.BlockSpec(slot_mapping.shape, lambda t, h: (0,)),
                row_spec, row_spec, pool_spec, pool_spec],
      out_specs=[pool_spec, pool_spec],
      out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                 jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
      num_warps=1, num_stages=1, aliases={3: 0, 4: 1},
      interpret=interpret, name="write_kv_gpu",
  )(slot_mapping.astype(jnp.int32), k_new.astype(k_pages.dtype),
    v_new.astype(v_pages.dtype), k_pages, v_pages)


@functools.partial(jax.jit, static_argnames=["backend", "interpret"])
def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    *,
    backend: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Writes each new token's K/V (all heads) into its pool slot.

  Args:
    k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    k_new, v_new: ``[num_tokens, num_kv_heads, head_dim]`` (cast to the pool
      dtype).
    slot_mapping: int32 ``[num_tokens]``; negative slots are padding and
      skipped.
    backend: ``None``/``"auto"``, ``"tpu"``, ``"gpu"`` or ``"xla"``.
    interpret: run the Pallas kernel in interpret mode (any host).

  Returns:
    The updated ``(k_pages, v_pages)``, aliasing the inputs.
  """
  check_pools(k_pages, v_pages)
  num_kv_heads, _, _, head_dim = k_pages.shape
  if (k_new.shape != v_new.shape or k_new.ndim != 3
      or k_new.shape[1:] != (num_kv_heads, head_dim)
      or slot_mapping.shape != k_new.shape[:1]):
    raise ValueError("k_new/v_new must be [num_tokens, num_kv_heads, "
                     "head_dim] and slot_mapping [num_tokens]; got "
                     f"{k_new.shape}, {v_new.shape}, {slot_mapping.shape}")
  impl = dispatch(backend, interpret, tpu=_write_kv_tpu,
                  gpu=_write_kv_gpu if _gpu_ok(k_pages) else None,
                  xla=reference.write_kv_reference)
  return tuple(impl(k_pages, v_pages, k_new, v_new, slot_mapping))


# ---------------------------------------------------------------------------
# copy_blocks
# ---------------------------------------------------------------------------


def _copy_blocks_tpu_kernel(src_ref, dst_ref, _k_in, _v_in, k_out, v_out, sem):
  num_copies = src_ref.shape[0]

  def run(method):
    def body(i, carry):
      src, dst = src_ref[i], dst_ref[i]

      @pl.when((src >= 0) & (dst >= 0))
      def _():
        for pages in (k_out, v_out):
          copy = pltpu.make_async_copy(pages.at[:, src], pages.at[:, dst], sem)
          getattr(copy, method)()
      return carry
    lax.fori_loop(0, num_copies, body, 0)

  run("start")
  run("wait")


def _copy_blocks_tpu(k_pages, v_pages, src, dst, *, interpret):
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return tpu_call(
      _copy_blocks_tpu_kernel, grid=(1,), num_scalar_prefetch=2,
      in_specs=[any_spec] * 2, out_specs=[any_spec] * 2,
      out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                 jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
      scratch_shapes=[pltpu.SemaphoreType.DMA(())], parallel=False,
      aliases={2: 0, 3: 1}, interpret=interpret, name="copy_blocks_tpu",
  )(src.astype(jnp.int32), dst.astype(jnp.int32), k_pages, v_pages)


def _copy_blocks_gpu_kernel(src_ref, dst_ref, _k_in, _v_in, k_out, v_out):
  i, h = pl.program_id(0), pl.program_id(1)
  src, dst = src_ref[i], dst_ref[i]

  @pl.when((src >= 0) & (dst >= 0))
  def _():
    for pages in (k_out, v_out):
      pages[h, dst] = pages[h, src]


def _copy_blocks_gpu(k_pages, v_pages, src, dst, *, interpret):
  num_kv_heads = k_pages.shape[0]
  ids_spec = pl.BlockSpec(src.shape, lambda i, h: (0,))
  pool_spec = pl.BlockSpec(k_pages.shape, lambda i, h: (0, 0, 0, 0))
  return gpu_call(
      _copy_blocks_gpu_kernel, grid=(src.shape[0], num_kv_heads),
      in_specs=[ids_spec, ids_spec, pool_spec, pool_spec],
      out_specs=[pool_spec, pool_spec],
      out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                 jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
      num_warps=4, num_stages=1, aliases={2: 0, 3: 1},
      interpret=interpret, name="copy_blocks_gpu",
  )(src.astype(jnp.int32), dst.astype(jnp.int32), k_pages, v_pages)


@functools.partial(jax.jit, static_argnames=["backend", "interpret"])
def copy_blocks(
    k_pages: jax.Array,
    v_pages: jax.Array,
    src: jax.Array,
    dst: jax.Array,
    *,
    backend: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Copies block ``src[i]`` to block ``dst[i]`` in every head of K and V.

  Used for copy-on-write of shared blocks and for swap-in; one call carries
  all copies of a step.

  Args:
    k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    src, dst: int32 ``[num_copies]`` block ids; a pair with a negative id is
      padding and skipped. Destinations must be distinct and not sources.
    backend: ``None``/``"auto"``, ``"tpu"``, ``"gpu"`` or ``"xla"``.
    interpret: run the Pallas kernel in interpret mode (any host).

  Returns:
    The updated ``(k_pages, v_pages)``, aliasing the inputs.
  """
  check_pools(k_pages, v_pages)
  if src.ndim != 1 or src.shape != dst.shape:
    raise ValueError(f"src and dst must both be [num_copies]; got {src.shape} "
                     f"and {dst.shape}")
  if src.shape[0] == 0:
    return k_pages, v_pages
  impl = dispatch(backend, interpret, tpu=_copy_blocks_tpu,
                  gpu=_copy_blocks_gpu if _gpu_ok(k_pages) else None,
                  xla=reference.copy_blocks_reference)
  return tuple(impl(k_pages, v_pages, src, dst))
