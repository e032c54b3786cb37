"""Ragged paged attention: prefill chunks and decode rows in one call.

The batch is a flat list of query tokens; sequence ``s`` owns rows
``query_start_loc[s]:query_start_loc[s + 1]`` and has ``seq_lens[s]`` tokens
of context *including* its new ones (their K/V are already in the pool). Its
row ``i`` (of ``q_len``) sits at position ``seq_lens[s] - q_len + i`` and
attends causally to keys ``0 .. position`` (with ``sliding_window``, to keys
``position - sliding_window < j <= position``; with ``attention_chunk``, Llama 4's
chunked local attention, to keys ``position // chunk * chunk <= j``; ``logits_soft_cap`` caps the
scaled logits with ``cap * tanh(s / cap)``; ``sinks``, one logit per head,
start every row's softmax: see ``paged_attention.py``). Sequences at/after ``num_seqs``
and rows at/after ``query_start_loc[num_seqs]`` are padding (zero output).
One call thus covers whole prompts, prefill chunks that continue after
cached tokens, and decode rows (``q_len == 1``).

Algorithm (both backends). Queries are regrouped per kv head as
``[num_kv_heads, num_tokens * group, head_dim]`` (row ``r`` is token
``r // group``), so the ``group`` query heads sharing a kv head form one
matrix and every page is read once per kv head and query tile. The grid is
``(num_kv_heads, num_query_tiles)``; a tile is ``num_queries_per_block``
consecutive tokens and may span several sequences. Per tile the kernel loops
over the sequences that own rows of it (a range precomputed by the wrapper),
and for each runs an online softmax over the compute blocks of
``pages_per_compute_block`` pages from the page holding the first key any of
its rows sees (the window's or the chunk's start) up to the tile's last causal position of
that sequence, then writes that sequence's rows of the tile. Every row
belongs to exactly one sequence, so no softmax state crosses sequences.

TPU (Mosaic): sequence lengths, query starts, per-tile sequence ranges and the
flattened block tables are scalar-prefetch operands; pages are DMA'd from HBM
into double-buffered VMEM, the next compute block's copies overlapping the
current block's math (within a sequence; the first block of each sequence
is not prefetched across sequences). Tiles are ``[num_queries_per_block *
group, head_dim]`` with ``num_queries_per_block`` a multiple of 16, so they
are (8, 128)/(16, 128)-aligned in the second-minor dimension.

GPU (Triton): the same loops; pages are gathered by block-id vectors, a
step's keys bounded so that its K/V tiles fit shared memory in every pipeline
stage, and the tile's rows bounded so that the accumulator and logits fit the
registers (``_gpu_tiling``). See ``paged_attention.py`` for why Triton and the
export caveat.

8-bit pages (``kv_scales``, see ``quant.py``): the scale words travel with
their pages (one more DMA / gather) and act on the key axis, as in
``paged_attention.py``; int8/float8 pages are cast to the query dtype (exact)
for the matmuls.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_kernels import quant
from pallas_kernels.jnp import attention as jnp_attention
from pallas_kernels.pallas.common import (
    PageCopies, attend_block, dispatch, finalize_softmax, gpu_block, gpu_call,
    gpu_keys_per_step, gpu_pool_specs, gpu_steps, gpu_supported, gpu_table, init_softmax_carry,
    optional_knobs, sink_rows, tpu_call, tpu_scale_buffer, unpack_scale_row, visible, window_start, with_scale_args)
from pallas_kernels.shapes import (check_attention_chunk, check_attention_shapes, check_knobs, check_sinks,
                                   next_power_of_two)

# Elements of a Triton program's [rows, head_dim or keys] tiles that 4 warps keep in registers
# without spilling (ptxas, sm_90: docs/tpu_gpu.md); up to twice as many get 8 warps.
GPU_TILE_ELEMENTS = 32 * 128


def _tile_metadata(query_start_loc, num_seqs, num_tiles, tile):
    """Sanitized query starts and the sequence range ``[first, end)`` per tile.

    Query starts of padding sequences are set to ``query_start_loc[num_seqs]``
    so that they own no rows.
    """
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    max_seqs = query_start_loc.shape[0] - 1
    qsl = query_start_loc.astype(jnp.int32)
    idx = jnp.arange(max_seqs + 1)
    qsl = jnp.where(idx <= num_seqs, qsl, qsl[num_seqs])
    real = jnp.arange(max_seqs) < num_seqs
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32)[:, None] * tile
    first = jnp.sum(real & (qsl[None, 1:] <= tile_start), axis=1)
    end = jnp.sum(real & (qsl[None, :-1] < tile_start + tile), axis=1)
    return qsl, first.astype(jnp.int32), end.astype(jnp.int32)


def _seq_rows(qsl_ref, seq_lens_ref, s, tile_start, tile, sliding_window, attention_chunk=None):
    """Where sequence ``s`` meets a tile.

    Returns ``(lo, hi, first_pos, kv_start, kv_end)``: its rows in the tile are
    flat tokens ``[lo, hi)``, flat token ``r`` is at position ``first_pos + r``,
    and keys ``[kv_start, kv_end)`` are the most any of those rows may see
    (empty when the sequence has no rows here).
    """
    q_start, q_end = qsl_ref[s], qsl_ref[s + 1]
    lo = jnp.maximum(q_start, tile_start)
    hi = jnp.minimum(q_end, tile_start + tile)
    first_pos = seq_lens_ref[s] - (q_end - q_start) - q_start
    kv_end = jnp.where(lo < hi, first_pos + hi, 0)
    kv_start = jnp.where(lo < hi, window_start(first_pos + lo, sliding_window, attention_chunk), 0)
    return lo, hi, first_pos, kv_start, kv_end


def _mask(first_pos, tile_start, col_start, group, shape, sliding_window, attention_chunk=None):
    rows = tile_start + lax.div(lax.broadcasted_iota(jnp.int32, shape, 0),
                                group)
    cols = col_start + lax.broadcasted_iota(jnp.int32, shape, 1)
    return visible(first_pos + rows, cols, sliding_window, attention_chunk)


def _row_mask(lo, hi, tile_start, group, n):
    rows = tile_start + lax.div(lax.broadcasted_iota(jnp.int32, (n, 1), 0),
                                group)
    return (rows >= lo) & (rows < hi)


# ---------------------------------------------------------------------------
# TPU (Mosaic) kernel.
# ---------------------------------------------------------------------------


def _tpu_kernel(
    # Scalar prefetch (SMEM).
    seq_lens_ref,  # [max_seqs]
    qsl_ref,  # [max_seqs + 1], sanitized
    first_seq_ref,  # [num_tiles]
    end_seq_ref,  # [num_tiles]
    block_tables_ref,  # [max_seqs * pages_per_seq]
    # Inputs.
    q_ref,  # [tile * group, head_dim] (VMEM), this kv head
    *refs,
    group: int,
    pages_per_seq: int,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    has_sinks: bool = False,
    attention_chunk: int | None = None,
):
    # refs: [sinks_ref [tile * group, 128] (VMEM) with sinks], then, m = 2 (K, V) or 3 (K, V,
    # scale words) pool arrays:
    #   m pools in HBM;
    #   o_ref [tile * group, head_dim];
    #   m VMEM buffers [2, pages_per_compute_block, ...];
    #   sems: DMA [m, 2].
    sinks = None
    if has_sinks:
        sinks, refs = refs[0][:, :1], refs[1:]
    m = (len(refs) - 2) // 2
    hbm, o_ref, bufs, sems = refs[:m], refs[m], refs[m + 1:2 * m + 1], refs[-1]
    k_buf, v_buf = bufs[:2]
    h, t = pl.program_id(0), pl.program_id(1)
    n, head_dim = q_ref.shape
    tile = n // group
    _, ppcb, block_size, _ = k_buf.shape
    bk = ppcb * block_size
    tile_start = t * tile
    # Merging (pages, block_size) into one sublane axis is layout-free only when
    # block_size is a multiple of the dtype's sublane tiling (8 rows of 32 bits,
    # 16 of bfloat16); otherwise compute in float32. 8-bit pages are cast to
    # the query dtype first.
    dtype = q_ref.dtype if m == 3 else k_buf.dtype
    packing = 4 // dtype.itemsize
    compute_dtype = dtype if block_size % (8 * packing) == 0 else jnp.float32
    q = q_ref[...].astype(compute_dtype)

    def seq_body(s, out):
        lo, hi, first_pos, kv_start, kv_end = _seq_rows(
            qsl_ref, seq_lens_ref, s, tile_start, tile, sliding_window, attention_chunk)
        first_page = lax.div(kv_start, block_size)
        num_pages = pl.cdiv(kv_end, block_size)
        num_steps = pl.cdiv(jnp.maximum(num_pages - first_page, 0), ppcb)

        def copies(step, slot):
            return PageCopies(hbm, bufs, sems, block_tables_ref, s * pages_per_seq,
                              first_page + step * ppcb, num_pages, h, slot)

        @pl.when(num_steps > 0)
        def _():
            copies(0, 0).start()

        def kv_body(step, carry):
            slot = step % 2

            @pl.when(step + 1 < num_steps)
            def _():
                copies(step + 1, 1 - slot).start()

            block = copies(step, slot)
            block.wait()
            start = (first_page + step * ppcb) * block_size
            k = k_buf[slot].astype(compute_dtype).reshape(bk, head_dim)
            v = v_buf[slot].astype(compute_dtype).reshape(bk, head_dim)
            rows = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            v = jnp.where(rows < kv_end, v, jnp.zeros_like(v))
            mask = _mask(first_pos, tile_start, start, group, (n, bk), sliding_window, attention_chunk)
            scale_rows = None
            if m == 3:  # 8-bit pages
                scale_rows = unpack_scale_row(
                    block.scale_words(bufs[2], slot),
                    start + lax.broadcasted_iota(jnp.int32, (1, bk), 1), kv_end)
            return attend_block(carry, q, k, v, mask, scale, scale_rows, logits_soft_cap)

        carry = lax.fori_loop(0, num_steps, kv_body,
                              init_softmax_carry(n, head_dim, sinks))
        rows = _row_mask(lo, hi, tile_start, group, n)
        return jnp.where(rows, finalize_softmax(carry), out)

    out = lax.fori_loop(first_seq_ref[t], end_seq_ref[t], seq_body,
                        jnp.zeros((n, head_dim), jnp.float32))
    o_ref[...] = out.astype(o_ref.dtype)


def _ragged_tpu(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
                num_seqs, *scales, scale, num_queries_per_block,
                pages_per_compute_block, sliding_window, logits_soft_cap, interpret, sinks=None,
                attention_chunk=None):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_seq = block_tables.shape[1]
    ppcb = min(pages_per_compute_block, pages_per_seq)
    tile = num_queries_per_block
    num_tiles = pl.cdiv(num_tokens, tile)
    qg, unpack = _group_queries(q, num_kv_heads, num_tiles * tile)
    qsl, first, end = _tile_metadata(query_start_loc, num_seqs, num_tiles, tile)
    qo_spec = pl.BlockSpec((None, tile * group, head_dim),
                           lambda h, t, *_: (h, t, 0))
    pools = (k_pages, v_pages, *scales)
    bufs = [pltpu.VMEM((2, ppcb) + x.shape[2:], x.dtype) for x in (k_pages, v_pages)]
    if scales:
        bufs.append(tpu_scale_buffer(ppcb, block_size))
    kernel = functools.partial(_tpu_kernel, group=group, pages_per_seq=pages_per_seq,
                               scale=scale, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, has_sinks=sinks is not None,
                               attention_chunk=attention_chunk)
    sink_inputs, sink_specs = (), []
    if sinks is not None:
        sink_inputs = (sink_rows(sinks, num_kv_heads, tile * group, lanes=128),)
        sink_specs = [pl.BlockSpec((None, tile * group, 128), lambda h, t, *_: (h, 0, 0))]
    out = tpu_call(
        kernel, grid=(num_kv_heads, num_tiles), num_scalar_prefetch=5,
        in_specs=[qo_spec] + sink_specs + [pl.BlockSpec(memory_space=pl.ANY)] * len(pools),
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        scratch_shapes=bufs + [pltpu.SemaphoreType.DMA((len(pools), 2))],
        interpret=interpret, name="ragged_paged_attention_tpu",
    )(seq_lens.astype(jnp.int32), qsl, first, end,
      block_tables.astype(jnp.int32).reshape(-1), qg, *sink_inputs, *pools)
    return unpack(out)


def _group_queries(q, num_kv_heads, padded_tokens, padded_group=None):
    """``[T, Hq, D] -> [KVH, padded_tokens * padded_group, D]`` and inverse."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    padded_group = padded_group or group
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, padded_tokens - num_tokens), (0, 0),
                      (0, padded_group - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)

    def unpack(out):
        out = out.reshape(num_kv_heads, padded_tokens, padded_group, head_dim)
        out = out[:, :num_tokens, :group].transpose(1, 0, 2, 3)
        return out.reshape(num_tokens, num_q_heads, head_dim)

    return qg, unpack


# ---------------------------------------------------------------------------
# GPU (Triton) kernel.
# ---------------------------------------------------------------------------


def _gpu_kernel(
    q_ref,  # [tile * group, head_dim], this kv head
    *refs,  # [sinks_ref (with sinks)], k_ref [num_blocks, block_size, head_dim] (this kv head),
            # v_ref (same), [words_ref ([num_word_blocks, block_size], this kv head; 8-bit pages only)],
            # then: block_tables_ref [max_seqs, pages_per_seq_padded],
            # seq_lens_ref [max_seqs], qsl_ref [max_seqs + 1] (sanitized),
            # first_seq_ref [num_tiles], end_seq_ref [num_tiles],
            # o_ref [tile * group, head_dim]
    group: int,
    keys: int,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    has_sinks: bool = False,
    attention_chunk: int | None = None,
):
    # sinks_ref: [tile * group] (this kv head)
    sinks = None
    if has_sinks:
        sinks, refs = refs[0][...][:, None], refs[1:]
    k_ref, v_ref, *refs = refs
    words_ref = refs[:-6]
    (block_tables_ref, seq_lens_ref, qsl_ref, first_seq_ref, end_seq_ref,
     o_ref) = refs[-6:]
    t = pl.program_id(1)
    n, head_dim = q_ref.shape
    tile = n // group
    block_size = k_ref.shape[1]
    tile_start = t * tile
    q = q_ref[...]

    def seq_body(s, out):
        lo, hi, first_pos, kv_start, kv_end = _seq_rows(
            qsl_ref, seq_lens_ref, s, tile_start, tile, sliding_window, attention_chunk)
        num_steps, locate = gpu_steps(kv_start, kv_end, block_size, keys)

        def table(page, count):
            if count is None:
                return block_tables_ref[s, page]
            return block_tables_ref[s, pl.ds(page, count)]

        def kv_body(step, carry):
            page, row0, start = locate(step)
            k, v, *words = gpu_block((k_ref, v_ref, *words_ref), table, page, row0, keys,
                                     head_dim)
            if words:  # 8-bit pages: cast (exact) to the query dtype
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            v = jnp.where((start + jnp.arange(keys) < kv_end)[:, None], v, 0)
            mask = _mask(first_pos, tile_start, start, group, (n, keys), sliding_window, attention_chunk)
            scale_rows = None
            if words:
                scale_rows = unpack_scale_row(words[0], start + jnp.arange(keys)[None, :], kv_end)
            return attend_block(carry, q, k, v, mask, scale, scale_rows, logits_soft_cap)

        carry = lax.fori_loop(0, num_steps, kv_body, init_softmax_carry(n, head_dim, sinks))
        rows = _row_mask(lo, hi, tile_start, group, n)
        return jnp.where(rows, finalize_softmax(carry), out)

    out = lax.fori_loop(first_seq_ref[t], end_seq_ref[t], seq_body,
                        jnp.zeros((n, head_dim), jnp.float32))
    o_ref[...] = out.astype(o_ref.dtype)


def _gpu_tiling(num_queries_per_block, group, head_dim, keys, eight_bit, windowed=False):
    """``(tile, num_warps)``: query tokens per program and warps, so that the ``[tile * group,
    head_dim]`` query and accumulator and the ``[tile * group, keys]`` logits stay in registers;
    ``tile * group >= 16`` (a dot's M dimension). A tile has at most ``2 * GPU_TILE_ELEMENTS``
    elements and gets 8 warps when it has more than ``GPU_TILE_ELEMENTS``; with 8-bit pages
    (cast to the query dtype in registers) or ``windowed`` (a sliding window over logits wider
    than head_dim: the mask's key positions live beside them) at most ``GPU_TILE_ELEMENTS``, and a
    windowed tile gets 8 warps from ``GPU_TILE_ELEMENTS / 2`` (so ptxas spills nothing on sm_80
    either)."""
    limit = GPU_TILE_ELEMENTS if eight_bit or windowed else 2 * GPU_TILE_ELEMENTS
    tile = next_power_of_two(max(num_queries_per_block, pl.cdiv(16, group)))
    while tile * group > 16 and tile * group * max(head_dim, keys) > limit:
        tile //= 2
    eight_warps = GPU_TILE_ELEMENTS // 2 if windowed else GPU_TILE_ELEMENTS
    return tile, 8 if tile * group * max(head_dim, keys) > eight_warps else 4


def _ragged_gpu(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
                num_seqs, *scales, scale, num_queries_per_block,
                pages_per_compute_block, sliding_window, logits_soft_cap, interpret, sinks=None,
                attention_chunk=None, num_stages=2):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    ppcb = next_power_of_two(min(pages_per_compute_block, pages_per_seq))
    keys = gpu_keys_per_step(head_dim, k_pages.dtype.itemsize, block_size, ppcb, num_stages)
    # Power-of-two tiles of at least 16 rows for Triton dots; a group that is
    # not a power of two is padded with zero query heads.
    group = next_power_of_two(num_q_heads // num_kv_heads)
    tile, num_warps = _gpu_tiling(num_queries_per_block, group, head_dim, keys, bool(scales),
                                  (sliding_window is not None or attention_chunk is not None) and keys > head_dim)
    num_tiles = pl.cdiv(num_tokens, tile)
    qg, unpack = _group_queries(q, num_kv_heads, num_tiles * tile, group)
    qsl, first, end = _tile_metadata(query_start_loc, num_seqs, num_tiles, tile)
    tables = gpu_table(block_tables, max(1, keys // block_size))
    qo_spec = pl.BlockSpec((None, tile * group, head_dim), lambda h, t: (h, t, 0))
    pool_specs, words = gpu_pool_specs(k_pages, scales, lambda h, t: h)

    def whole(x):
        return pl.BlockSpec(x.shape, lambda h, t: (0,) * x.ndim)

    metadata = (tables, seq_lens.astype(jnp.int32), qsl, first, end)
    kernel = functools.partial(_gpu_kernel, group=group, keys=keys, scale=scale,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               has_sinks=sinks is not None, attention_chunk=attention_chunk)
    sink_inputs, sink_specs = (), []
    if sinks is not None:
        sink_inputs = (sink_rows(sinks, num_kv_heads, tile * group, group),)
        sink_specs = [pl.BlockSpec((None, tile * group), lambda h, t: (h, 0))]
    out = gpu_call(
        kernel, grid=(num_kv_heads, num_tiles),
        in_specs=[qo_spec, *sink_specs, *pool_specs, *map(whole, metadata)],
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, name="ragged_paged_attention_gpu",
    )(qg, *sink_inputs, k_pages, v_pages, *words, *metadata)
    return unpack(out)


# ---------------------------------------------------------------------------
# Public entry point.
# ---------------------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=["scale", "num_queries_per_block", "pages_per_compute_block",
                     "sliding_window", "logits_soft_cap", "attention_chunk", "backend", "interpret"])
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    scale: float,
    num_queries_per_block: int = 16,
    pages_per_compute_block: int = 8,
    kv_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    attention_chunk: int | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention for a flat batch of prefill and decode tokens.

    Args:
      q: ``[num_tokens, num_q_heads, head_dim]``.
      k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``,
        already holding this step's K/V.
      block_tables: int32 ``[max_seqs, max_blocks_per_seq]``.
      seq_lens: int32 ``[max_seqs]``, context length including new tokens.
      query_start_loc: int32 ``[max_seqs + 1]``, row offsets of each sequence.
      num_seqs: int32 scalar or ``[1]``, number of real sequences.
      scale: softmax scale applied to ``q @ k``.
      num_queries_per_block: query tokens per tile (TPU: a multiple of 16;
        GPU: rounded to a power of two with ``tile * group >= 16``, and
        lowered until the tile's accumulator fits the registers).
      pages_per_compute_block: pages per online-softmax step.
      kv_scales: uint32 ``[num_kv_heads, scale_rows, 128]`` with int8/float8_e4m3fn
        pages (``quant.py``), else None.
      sliding_window: None, or a row at position ``p`` sees only keys ``j > p -
        sliding_window``.
      logits_soft_cap: None, or the scaled logits ``s`` become ``cap * tanh(s / cap)``.
      sinks: None, or float ``[num_q_heads]``: each head's attention sink (gpt-oss).
      attention_chunk: None, or a row at position ``p`` sees only the keys of its chunk,
        ``j >= p // attention_chunk * attention_chunk`` (Llama 4's chunked local attention).
      backend: ``None``/``"auto"``, ``"tpu"``, ``"gpu"`` or ``"xla"``; see
        ``paged_attention.py``.
      interpret: run the Pallas kernel in interpret mode (any host).

    Returns:
      ``[num_tokens, num_q_heads, head_dim]`` in ``q.dtype``; padding rows are
      zeros.
    """
    check_attention_shapes(q, k_pages, v_pages, block_tables, seq_lens)
    check_knobs(sliding_window, logits_soft_cap)
    check_sinks(sinks, q.shape[1])
    check_attention_chunk(attention_chunk)
    scales = quant.pools_of(k_pages, v_pages, kv_scales)[2:]
    if query_start_loc.shape != (block_tables.shape[0] + 1,):
        raise ValueError(f"query_start_loc must be [max_seqs + 1] = "
                         f"[{block_tables.shape[0] + 1}], got "
                         f"{query_start_loc.shape}")
    if jnp.size(num_seqs) != 1:
        raise ValueError(f"num_seqs must be a scalar or [1], got {num_seqs.shape}")
    if num_queries_per_block < 1 or pages_per_compute_block < 1:
        raise ValueError("num_queries_per_block and pages_per_compute_block must "
                         "be >= 1")
    num_kv_heads, _, block_size, head_dim = k_pages.shape
    knobs = dict(scale=scale, num_queries_per_block=num_queries_per_block,
                 pages_per_compute_block=pages_per_compute_block,
                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    extra = optional_knobs(sinks=sinks, attention_chunk=attention_chunk)
    knobs.update(extra)
    tpu_ok = num_queries_per_block % 16 == 0
    gpu_ok = gpu_supported(head_dim, block_size)
    impl = dispatch(
        backend, interpret,
        tpu=functools.partial(_ragged_tpu, **knobs) if tpu_ok else None,
        gpu=functools.partial(_ragged_gpu, **knobs) if gpu_ok else None,
        xla=with_scale_args(jnp_attention.ragged_paged_attention_reference, 7, scale=scale,
                            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                            **extra))
    return impl(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
                num_seqs, *scales)
