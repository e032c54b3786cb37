"""Helpers shared by the Pallas kernels: backend dispatch, the online-softmax update, TPU page
copies and the two ``pallas_call`` set-ups (Mosaic TPU with scalar prefetch, Triton GPU).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jpaged_kernels.shapes import DEFAULT_MASK_VALUE, is_power_of_2

# Pass to ``jax.export.export(..., disabled_checks=EXPORT_DISABLED_CHECKS)``
# when exporting the Triton (CUDA) kernels; see ``paged_attention.py``.
EXPORT_DISABLED_CHECKS = (
    jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
)

BACKENDS = (None, "auto", "tpu", "gpu", "xla")


# ---------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------


def dispatch(
    backend: str | None,
    interpret: bool,
    *,
    tpu: Callable | None,
    gpu: Callable | None,
    xla: Callable,
) -> Callable:
    """Chooses an implementation; see ``paged_attention.py`` for the rules.

    ``tpu``/``gpu`` take an ``interpret`` keyword and are ``None`` when the
    shapes are not supported by that kernel (then the reference is used in
    auto mode, and an explicit request raises).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "xla":
        return xla
    if backend in ("tpu", "gpu"):
        impl = tpu if backend == "tpu" else gpu
        if impl is None:
            raise ValueError(f"these shapes are not supported by the {backend} "
                             "kernel; see the module docstring")
        return functools.partial(impl, interpret=interpret)
    if interpret:
        return functools.partial(tpu, interpret=True) if tpu else xla

    def auto(*args):
        branches = {"default": xla}
        if tpu is not None:
            branches["tpu"] = functools.partial(tpu, interpret=False)
        if gpu is not None:
            branches["cuda"] = functools.partial(gpu, interpret=False)
        return lax.platform_dependent(*args, **branches)

    return auto


def with_scale_args(reference_fn, num_leading: int, **kw):
    """``reference_fn`` called with the scales of 8-bit pages as trailing
    positional arguments after ``num_leading`` others (how ``dispatch`` passes
    them: ``lax.platform_dependent`` takes positional operands only), turned
    into its ``k_scales=``/``v_scales=`` keywords."""
    def call(*args):
        lead, scales = args[:num_leading], args[num_leading:]
        extra = dict(k_scales=scales[0], v_scales=scales[1]) if scales else {}
        return reference_fn(*lead, **kw, **extra)
    return call


def gpu_supported(head_dim: int, block_size: int) -> bool:
    """Triton needs power-of-two tiles."""
    return (is_power_of_2(head_dim) and head_dim >= 16
            and is_power_of_2(block_size))


# ---------------------------------------------------------------------------
# pallas_call set-ups.
# ---------------------------------------------------------------------------


def tpu_call(kernel, *, grid, num_scalar_prefetch, in_specs, out_specs,
             out_shape, scratch_shapes, parallel=True, aliases=None,
             interpret, name):
    """A Mosaic TPU ``pallas_call`` with scalar prefetch.

    ``parallel``: every grid axis is independent (megacore may split it);
    otherwise the call has side effects (it writes through aliased pools).
    """
    if parallel:
        params = pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid))
    else:
        params = pltpu.CompilerParams(has_side_effects=True)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalar_prefetch, grid=grid,
            in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch_shapes),
        compiler_params=params, out_shape=out_shape,
        input_output_aliases=aliases or {}, interpret=interpret, name=name)


def gpu_call(kernel, *, grid, in_specs, out_specs, out_shape, num_warps=4,
             num_stages=2, aliases=None, interpret, name):
    """A Triton ``pallas_call``."""
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                             num_stages=num_stages),
        input_output_aliases=aliases or {}, interpret=interpret, name=name)


# ---------------------------------------------------------------------------
# Online softmax (inside kernels).
# ---------------------------------------------------------------------------


def online_softmax_step(carry, logits, v, mask, v_scale=None):
    """One flash-attention update.

    Args:
      carry: ``(m, l, acc)``: running max ``[n, 1]``, running sum ``[n, 1]``
        and unnormalized output ``[n, d]``, all float32.
      logits: ``[n, t]`` float32 scaled logits.
      v: ``[t, d]`` values (rows where no query may look must be finite).
      mask: bool ``[n, t]``, True where a query may look at a key.
      v_scale: None, or float32 ``[1, t]``: value row ``j`` stands for
        ``v_scale[j] * v[j]`` (8-bit pages); it scales the softmax weights of
        the PV product (not the running sum), so ``v`` is never dequantized.

    Returns:
      The new ``(m, l, acc)``.
    """
    m_prev, l_prev, acc_prev = carry
    logits = jnp.where(mask, logits, DEFAULT_MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(logits - m_next), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv_weights = p if v_scale is None else p * v_scale
    pv = jnp.dot(pv_weights.astype(v.dtype), v,
                 preferred_element_type=jnp.float32)
    return m_next, l_next, alpha * acc_prev + pv


def init_softmax_carry(n: int, d: int):
    return (jnp.full((n, 1), -jnp.inf, jnp.float32),
            jnp.zeros((n, 1), jnp.float32),
            jnp.zeros((n, d), jnp.float32))


def finalize_softmax(carry):
    """acc / l, with rows that saw no key (l == 0) set to zero."""
    _, l, acc = carry
    return jnp.where(l > 0.0, acc / jnp.where(l > 0.0, l, 1.0), 0.0)


def qk_logits(q, k, scale):
    """``scale * q @ k.T`` in float32: q ``[n, d]``, k ``[t, d]``."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)
    return s * scale


def scale_row(scales, valid_len=None, start=0):
    """``[pages, block_size]`` scales of a compute block as float32 ``[1, t]``
    key-axis factors; with ``valid_len``, columns at/after it (pages that were
    not fetched) are zero so that garbage never meets a zero weight."""
    row = scales.astype(jnp.float32).reshape(1, -1)
    if valid_len is not None:
        cols = start + lax.broadcasted_iota(jnp.int32, row.shape, 1)
        row = jnp.where(cols < valid_len, row, 0.0)
    return row


def attend_block(carry, q, k, v, mask, scale, kv_scales=None, kv_len=None, start=0):
    """One online-softmax update of ``q`` against a compute block's keys ``k``
    and values ``v`` (`qk_logits`, then `online_softmax_step`).

    ``kv_scales``: None, or with 8-bit pages the block's ``(k_scales,
    v_scales)``, each ``[pages, block_size]``: K scales multiply the logits, V
    scales the softmax weights (pages are never dequantized); V scale columns
    at/after ``kv_len`` (``start`` is the block's first key position) are zero.
    """
    logits = qk_logits(q, k, scale)
    v_scale = None
    if kv_scales is not None:
        logits = logits * scale_row(kv_scales[0])
        v_scale = scale_row(kv_scales[1], kv_len, start)
    return online_softmax_step(carry, logits, v, mask, v_scale)


class PageCopies:
    """Async copies of one compute block's pages of one kv head (TPU).

    For each ``(hbm, buf)`` pair (K and V pages; and their scales with 8-bit
    pages), copies ``hbm[head, block_id]`` for ``pages_per_compute_block``
    block ids read from the block table in SMEM into ``buf.at[slot]``, on
    semaphore ``sems[pair, slot]``. Page ``j`` is only copied (and waited on)
    when ``first_page + j < num_pages``, so pages past a sequence's end are
    never fetched.
    """

    def __init__(self, hbm_refs, bufs, sems, block_tables_ref, table_offset,
                 first_page, num_pages, head, slot):
        self._copies = []
        for j in range(bufs[0].shape[1]):
            page = first_page + j
            page_in_table = jnp.minimum(page, num_pages - 1)
            block_id = block_tables_ref[table_offset + page_in_table]
            group = [pltpu.make_async_copy(src.at[head, block_id], buf.at[slot, j],
                                           sems.at[i, slot])
                     for i, (src, buf) in enumerate(zip(hbm_refs, bufs))]
            self._copies.append((page < num_pages, group))

    def start(self):
        for needed, group in self._copies:
            @pl.when(needed)
            def _():
                for c in group:
                    c.start()

    def wait(self):
        for needed, group in self._copies:
            @pl.when(needed)
            def _():
                for c in group:
                    c.wait()
