"""Helpers shared by the Pallas kernels: backend dispatch, the pallas_call set-ups (Mosaic TPU
with scalar prefetch, Triton GPU), the attention masks and online-softmax update, and the TPU
page copies with their 8-bit scale rows.
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

from pallas_kernels import quant
from pallas_kernels.shapes import DEFAULT_MASK_VALUE, is_power_of_2

# Pass to ``jax.export.export(..., disabled_checks=EXPORT_DISABLED_CHECKS)``
# when exporting the Triton (CUDA) kernels; see ``paged_attention.py``.
EXPORT_DISABLED_CHECKS = (
    jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
)

BACKENDS = (None, "auto", "tpu", "gpu", "xla")
# Shared memory the Triton attention kernels give their pipelined K/V tiles (all stages): an
# A100 lets a block opt in to 163 KiB, an H100 to 227 KiB; the rest is Triton's own scratch.
GPU_KV_SMEM_BYTES = 96 * 1024
# Elements of an 8-bit K (or V) tile a Triton program casts in registers without spilling.
GPU_CAST_ELEMENTS = 32 * 128


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
    """``reference_fn`` called with the scale words of 8-bit pages as a trailing positional
    argument after ``num_leading`` others (how ``dispatch`` passes them:
    ``lax.platform_dependent`` takes positional operands only), turned into ``kv_scales=``."""
    def call(*args):
        lead, scales = args[:num_leading], args[num_leading:]
        return reference_fn(*lead, **kw, **({"kv_scales": scales[0]} if scales else {}))
    return call


def gpu_supported(head_dim: int, block_size: int) -> bool:
    """Triton needs power-of-two tiles."""
    return (is_power_of_2(head_dim) and head_dim >= 16
            and is_power_of_2(block_size))


def gpu_keys_per_step(head_dim: int, itemsize: int, block_size: int, pages: int,
                      num_stages: int) -> int:
    """Keys per online-softmax step of a Triton attention kernel: ``pages`` pages, fewer when
    their K and V tiles in all pipeline stages would pass `GPU_KV_SMEM_BYTES` of shared memory,
    or (8-bit pages, cast to the query dtype in registers) a K tile would pass
    `GPU_CAST_ELEMENTS`; then possibly a part of one page. A power of two, at least 16 (a dot's
    K dimension)."""
    def too_big(keys):
        smem = 2 * num_stages * keys * head_dim * itemsize > GPU_KV_SMEM_BYTES
        return smem or (itemsize == 1 and keys * head_dim > GPU_CAST_ELEMENTS)

    keys = pages * block_size
    while keys > 16 and too_big(keys):
        keys //= 2
    return max(keys, 16)


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
# Masks and the online softmax (inside kernels).
# ---------------------------------------------------------------------------


def optional_knobs(*, sinks=None, attention_chunk=None) -> dict:
    """The knobs a caller set among ``sinks`` and ``attention_chunk``: only those are passed on, so
    the kernels (and their compiled code) without sinks or chunks are unchanged."""
    return {name: value for name, value in (("sinks", sinks), ("attention_chunk", attention_chunk))
            if value is not None}


def chunk_start(position, attention_chunk):
    """The first position of the attention chunk holding ``position`` (>= 0):
    ``position // chunk * chunk``, by truncating division (positions are not negative)."""
    return lax.div(position, attention_chunk) * attention_chunk


def window_start(position, sliding_window, attention_chunk=None):
    """First key a query at ``position`` sees: 0, or ``position - sliding_window + 1`` (>= 0),
    and not before the first position of its attention chunk."""
    start = jnp.zeros_like(position) if sliding_window is None else jnp.maximum(position - sliding_window + 1, 0)
    if attention_chunk is not None:
        start = jnp.maximum(start, chunk_start(position, attention_chunk))
    return start


def visible(q_pos, k_pos, sliding_window, attention_chunk=None):
    """Causal mask, with the sliding window and the attention chunk (Llama 4: ``p // chunk *
    chunk <= j``) where set: key ``k_pos`` is visible from ``q_pos``."""
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if attention_chunk is not None:
        mask &= k_pos >= chunk_start(q_pos, attention_chunk)
    return mask


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


def init_softmax_carry(n: int, d: int, sinks=None):
    """The online softmax's start ``(m, l, acc)``; ``sinks``: None, or float32 ``[n, 1]``, each
    row's attention sink, which starts the softmax as one logit already seen with a zero value
    (``m = sink``, ``l = 1``), so it stays in the denominator."""
    if sinks is not None:
        return sinks.astype(jnp.float32), jnp.ones((n, 1), jnp.float32), jnp.zeros((n, d), jnp.float32)
    return (jnp.full((n, 1), -jnp.inf, jnp.float32),
            jnp.zeros((n, 1), jnp.float32),
            jnp.zeros((n, d), jnp.float32))


def sink_rows(sinks, num_kv_heads: int, rows: int, padded_group: int | None = None, lanes: int | None = None):
    """The attention sinks ``[num_q_heads]`` laid out like a kernel's query tile: float32
    ``[num_kv_heads, rows]`` (``[num_kv_heads, rows, lanes]`` with ``lanes``, each value repeated
    along them: a Mosaic block), row ``r`` holding the sink of query head ``r % padded_group`` of
    its kv head (heads padded past the real group get 0)."""
    group = sinks.shape[0] // num_kv_heads
    padded_group = padded_group or group
    per_head = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, group), ((0, 0), (0, padded_group - group)))
    out = jnp.tile(per_head, (1, rows // padded_group))
    return out if lanes is None else jnp.broadcast_to(out[:, :, None], out.shape + (lanes,))


def finalize_softmax(carry):
    """acc / l, with rows that saw no key (l == 0) set to zero."""
    _, l, acc = carry
    return jnp.where(l > 0.0, acc / jnp.where(l > 0.0, l, 1.0), 0.0)


def attend_block(carry, q, k, v, mask, scale, kv_scale_rows=None, logits_soft_cap=None):
    """One online-softmax update of ``q [n, d]`` against a compute block's keys ``k [t, d]`` and
    values ``v [t, d]``.

    Args:
      carry: see `online_softmax_step`.
      mask: bool ``[n, t]``.
      scale: softmax scale of ``q @ k``.
      kv_scale_rows: None, or with 8-bit pages float32 ``(k_scale [1, t], v_scale [1, t])``: K
        scales multiply the logits, V scales the softmax weights (pages are never dequantized);
        V scales of keys that were not fetched must be zero.
      logits_soft_cap: None, or the scaled logits ``s`` become ``cap * tanh(s / cap)``.

    Returns:
      The new carry.
    """
    logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * scale
    v_scale = None
    if kv_scale_rows is not None:
        logits = logits * kv_scale_rows[0]
        v_scale = kv_scale_rows[1]
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    return online_softmax_step(carry, logits, v, mask, v_scale)


def unpack_scale_row(words, cols, kv_end):
    """float32 ``(k_scale, v_scale)`` rows of packed scale words ``[1, t]``; V scales at key
    columns ``cols >= kv_end`` (pages not fetched) are zero."""
    k_scale, v_scale = quant.unpack_scales(words)
    return k_scale, jnp.where(cols < kv_end, v_scale, 0.0)


# ---------------------------------------------------------------------------
# Triton compute blocks.
# ---------------------------------------------------------------------------


def gpu_block(refs, table, page, row0, keys, head_dim):
    """Keys ``[keys, head_dim]`` (or ``[1, keys]`` scale words) of a Triton compute block.

    ``table(page, n)`` reads ``n`` block ids from table column ``page`` (``n`` None: one id). With
    ``row0`` None the block is ``keys // block_size`` whole pages, else rows ``row0 .. row0 +
    keys`` of one page.
    """
    if row0 is None:
        block_size = refs[0].shape[1]
        ids = table(page, keys // block_size)
        loads = [ref[ids] for ref in refs]
    else:
        block_id = table(page, None)
        loads = [ref[block_id, pl.ds(row0, keys)] for ref in refs]
    return [x.reshape(keys, head_dim) if ref.ndim == 3 else x.reshape(1, keys)
            for ref, x in zip(refs, loads)]


def gpu_steps(kv_start, kv_end, block_size, keys):
    """``(num_steps, locate)`` of a Triton kernel's loop over keys ``[kv_start,
    kv_end)`` in steps of ``keys``: ``locate(step)`` gives ``(page offset in the table, row
    offset in the page or None, first key position)``."""
    first_page = lax.div(kv_start, block_size)
    base = first_page * block_size
    num_steps = pl.cdiv(jnp.maximum(kv_end - base, 0), keys)

    def locate(step):
        start = base + step * keys
        if keys >= block_size:
            return first_page + step * (keys // block_size), None, start
        return lax.div(start, block_size), lax.rem(start, block_size), start

    return num_steps, locate


def gpu_pool_specs(k_pages, scales, index_map):
    """BlockSpecs of one kv head's pages (and scale words seen as ``[blocks, block_size]``)."""
    num_blocks, block_size, head_dim = k_pages.shape[1:]
    specs = [pl.BlockSpec((None, num_blocks, block_size, head_dim),
                          lambda *i: (index_map(*i), 0, 0, 0))] * 2
    words = [quant.block_words(w, block_size) for w in scales]
    specs += [pl.BlockSpec((None,) + w.shape[1:], lambda *i: (index_map(*i), 0, 0))
              for w in words]
    return specs, words


def gpu_table(block_tables, pages):
    """Block tables padded so that a step's slice of ``pages`` ids starting at any used page
    stays in bounds."""
    return jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pages)))


# ---------------------------------------------------------------------------
# TPU page copies.
# ---------------------------------------------------------------------------


def tpu_scale_buffer(pages_per_compute_block: int, block_size: int):
    """VMEM scratch for the scale words of a compute block, double-buffered: one 128-word row of
    ``kv_scales`` per page (a row holds ``128 / block_size`` pages' words), or ``block_size /
    128`` rows."""
    rows = max(1, block_size // quant.LANES)
    return pltpu.VMEM((2, pages_per_compute_block, rows, quant.LANES), quant.SCALE_WORD_DTYPE)


def _scale_rows_of(block_id, block_size):
    """``(first row, rows)`` of ``kv_scales`` holding block ``block_id``'s words."""
    if block_size >= quant.LANES:
        rows = block_size // quant.LANES
        return block_id * rows, rows
    return lax.div(block_id * block_size, quant.LANES), 1


class PageCopies:
    """Async copies of one compute block's pages of one kv head (TPU).

    Copies ``k_pages[head, block_id]`` and ``v_pages[head, block_id]`` for
    ``pages_per_compute_block`` block ids read from the block table in SMEM into
    ``bufs[0|1].at[slot, j]`` (with 8-bit pages also the 128-word row(s) of
    ``kv_scales`` holding the page's words into ``bufs[2].at[slot, j]``), on
    semaphores ``sems[i, slot]``. Page ``j`` is only copied (and waited on)
    when ``first_page + j < num_pages``, so pages past a sequence's end are
    never fetched.
    """

    def __init__(self, hbm_refs, bufs, sems, block_tables_ref, table_offset,
                 first_page, num_pages, head, slot):
        self._copies = []
        self.block_ids = []
        self.block_size = block_size = bufs[0].shape[2]
        for j in range(bufs[0].shape[1]):
            page = first_page + j
            page_in_table = jnp.clip(page, 0, jnp.maximum(num_pages - 1, 0))
            block_id = block_tables_ref[table_offset + page_in_table]
            self.block_ids.append(block_id)
            srcs = [hbm_refs[0].at[head, block_id], hbm_refs[1].at[head, block_id]]
            if len(hbm_refs) > 2:
                row, rows = _scale_rows_of(block_id, block_size)
                srcs.append(hbm_refs[2].at[head, pl.ds(row, rows)])
            group = [pltpu.make_async_copy(src, buf.at[slot, j], sems.at[i, slot])
                     for i, (src, buf) in enumerate(zip(srcs, bufs))]
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

    def scale_words(self, buf, slot):
        """The compute block's scale words as one ``[1, pages * block_size]`` row, in key order.

        ``buf`` is the scale buffer of `tpu_scale_buffer`; each page's words sit in its row at
        lane ``(block_id * block_size) % 128`` and are rotated to the page's key columns.
        """
        _, ppcb, rows, lanes = buf.shape
        block_size = self.block_size
        if block_size >= lanes:
            return jnp.concatenate([buf[slot, j, pl.ds(r, 1), :] for j in range(ppcb)
                                    for r in range(rows)], axis=1)
        per_row = lanes // block_size
        lane_page = lax.div(lax.broadcasted_iota(jnp.int32, (1, lanes), 1), block_size)
        chunks = []
        for c in range(pl.cdiv(ppcb, per_row)):
            chunk = jnp.zeros((1, lanes), buf.dtype)
            for j in range(c * per_row, min((c + 1) * per_row, ppcb)):
                src = lax.rem(self.block_ids[j] * block_size, lanes)
                dst = (j % per_row) * block_size
                shift = lax.rem(dst - src + lanes, lanes)
                moved = pltpu.roll(buf[slot, j], shift, 1)
                chunk = jnp.where(lane_page == j % per_row, moved, chunk)
            chunks.append(chunk)
        row = jnp.concatenate(chunks, axis=1) if len(chunks) > 1 else chunks[0]
        return row[:, :ppcb * block_size]
