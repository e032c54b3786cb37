"""PagedAttention decode kernel: one query token per sequence.

Reads K/V straight from the block pool through the block tables with an
online (flash) softmax over compute blocks of ``pages_per_compute_block``
pages; gathered K/V are never materialized in HBM, and only the pages that
hold a sequence's ``seq_lens[s]`` tokens are read.

Layout (shared by every kernel in this package):
  q:        ``[num_seqs, num_q_heads, head_dim]``
  k_pages:  ``[num_kv_heads, num_blocks, block_size, head_dim]`` (v_pages same)
  block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; entries past a
    sequence's used blocks may be any valid block id.
  seq_lens: int32 ``[num_seqs]``.
  ``num_q_heads = num_kv_heads * group``; query head ``h`` reads kv head
  ``h // group``.
  kv_scales (optional, with int8/float8_e4m3fn pages): uint32
    ``[num_kv_heads, scale_rows, 128]``, one word per slot holding its K and V
    scales (``quant.py``), fetched page by page with K/V; a compute block's
    scales are one ``[1, pages * block_size]`` row that multiplies the
    ``q @ k`` logits (K) and the softmax weights of the PV product (V), so
    pages are only cast, never dequantized element-wise.

Knobs: ``sliding_window`` (a query at position ``p`` sees keys ``j`` with
``p - sliding_window < j <= p``) and ``logits_soft_cap`` (``cap * tanh(s /
cap)`` on the scaled logits, Gemma 2). With a window the kernels start at the
page holding the first visible key: work follows the window, not the context.
``attention_chunk`` (Llama 4's chunked local attention): a query at position ``p`` sees keys
``p // chunk * chunk <= j <= p``, the kernels starting at its chunk's first page.
``sinks`` (gpt-oss), float ``[num_q_heads]``: a logit per head in the softmax's
denominator with no value; the kernels start each row's online softmax from it
(``m = sink``, ``l = 1``), an extra ``[group, 128]`` (TPU) / ``[group]`` (GPU)
input block per kv head.

Backends (``backend=``):
  * ``"tpu"``: Mosaic TPU. Grid ``(num_seqs, num_kv_heads)``, both parallel
    (no state crosses grid steps, so megacore can split either axis).
    ``seq_lens`` and the flattened block tables are scalar-prefetch operands
    (SMEM); K/V stay in HBM (``pl.ANY``) and each compute block's pages are
    DMA'd into a double-buffered VMEM scratch, the next block's copies in
    flight while the current one is computed. Pages past the sequence end (or
    before its window) are not fetched; with 8-bit pages each page's scale
    words come with one more DMA of the 128-word row holding them, and a lane
    rotation puts them under the page's key columns. All ``group`` query heads sharing a kv head are one
    ``[group, head_dim]`` tile, so each page is read once per kv head.
  * ``"gpu"``: Triton (``pallas.triton``). Grid ``(num_seqs, num_kv_heads)``;
    a program gathers ``pages_per_compute_block`` pages per step by block id,
    or fewer keys (part of a page) when the step's K/V tiles in every pipeline
    stage would pass ``GPU_KV_SMEM_BYTES`` of shared memory.
    Triton rather than Mosaic GPU because (1) paged access is a gather by a
    vector of block ids, which Triton lowering supports directly, while
    Mosaic GPU wants TMA copies and warpgroup-level code; (2) Triton runs on
    Ampere and Hopper alike, Mosaic GPU targets sm_90+; (3) Triton kernels
    run under ``interpret=True`` on CPU, so their math is tested here without
    a GPU. Both lower from CPU with jax 0.10.2. The cost: XLA does not list
    the Triton custom call (``__gpu$xla.gpu.triton``) as a stable export
    target, so ``jax.export`` for ``cuda`` needs
    ``disabled_checks=EXPORT_DISABLED_CHECKS`` (``jax.jit`` is unaffected).
    Triton needs power-of-two tiles: ``head_dim`` and ``block_size`` must be
    powers of two; the query-head group is padded to at least 16 rows.
  * ``"xla"``: the pure-jnp reference (``jnp/attention.py``).
  * ``None``/``"auto"``: ``lax.platform_dependent`` picks the TPU kernel when
    lowering for TPU, the Triton kernel for CUDA, and the reference elsewhere
    (CPU, ROCm, or shapes a kernel does not support). With
    ``interpret=True`` auto means the TPU kernel, interpreted on any host.
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
    optional_knobs, sink_rows, tpu_call, tpu_scale_buffer, unpack_scale_row, window_start, with_scale_args)
from pallas_kernels.shapes import (check_attention_chunk, check_attention_shapes, check_knobs, check_sinks,
                                   next_power_of_two)


# ---------------------------------------------------------------------------
# TPU (Mosaic) kernel.
# ---------------------------------------------------------------------------


def _tpu_kernel(
    # Scalar prefetch (SMEM).
    seq_lens_ref,  # [num_seqs]
    block_tables_ref,  # [num_seqs * pages_per_seq]
    # Inputs.
    q_ref,  # [group, head_dim] (VMEM)
    *refs,
    pages_per_seq: int,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    has_sinks: bool = False,
    attention_chunk: int | None = None,
):
    # refs: [sinks_ref [group, 128] (VMEM) with sinks], then, n = 2 (K, V) or 3 (K, V, scale
    # words) pool arrays:
    #   n pools in HBM;
    #   o_ref [group, head_dim];
    #   n VMEM buffers [2 (slot), pages_per_compute_block, ...];
    #   sems: DMA [n, 2 (slot)].
    sinks = None
    if has_sinks:
        sinks, refs = refs[0][:, :1], refs[1:]
    n = (len(refs) - 2) // 2
    hbm, o_ref, bufs, sems = refs[:n], refs[n], refs[n + 1:2 * n + 1], refs[-1]
    s, h = pl.program_id(0), pl.program_id(1)
    _, ppcb, block_size, head_dim = bufs[0].shape
    bk = ppcb * block_size
    group = q_ref.shape[0]
    seq_len = seq_lens_ref[s]
    kv_start = window_start(seq_len - 1, sliding_window, attention_chunk)
    first_page = lax.div(kv_start, block_size)
    num_pages = pl.cdiv(seq_len, block_size)
    num_steps = pl.cdiv(num_pages - first_page, ppcb)

    def copies(step, slot):
        return PageCopies(hbm, bufs, sems, block_tables_ref, s * pages_per_seq,
                          first_page + step * ppcb, num_pages, h, slot)

    @pl.when(num_steps > 0)
    def _():
        copies(0, 0).start()

    q = q_ref[...].astype(jnp.float32)

    def body(step, carry):
        slot = step % 2

        @pl.when(step + 1 < num_steps)
        def _():
            copies(step + 1, 1 - slot).start()

        block = copies(step, slot)
        block.wait()
        start = (first_page + step * ppcb) * block_size
        # Cast before merging (pages, block_size): float32 tiles are (8, 128), so
        # the merge is layout-free for any block_size that is a multiple of 8.
        k = bufs[0][slot].astype(jnp.float32).reshape(bk, head_dim)
        v = bufs[1][slot].astype(jnp.float32).reshape(bk, head_dim)
        rows = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        v = jnp.where(rows < seq_len, v, 0.0)  # unfetched pages hold garbage
        cols = start + lax.broadcasted_iota(jnp.int32, (group, bk), 1)
        mask = (cols < seq_len) & (cols >= kv_start)
        scale_rows = None
        if n == 3:  # 8-bit pages
            words = block.scale_words(bufs[2], slot)
            scale_rows = unpack_scale_row(
                words, start + lax.broadcasted_iota(jnp.int32, (1, bk), 1), seq_len)
        return attend_block(carry, q, k, v, mask, scale, scale_rows, logits_soft_cap)

    carry = lax.fori_loop(0, num_steps, body, init_softmax_carry(group, head_dim, sinks))
    o_ref[...] = finalize_softmax(carry).astype(o_ref.dtype)


def _paged_attention_tpu(q, k_pages, v_pages, block_tables, seq_lens, *scales,
                         scale, pages_per_compute_block, sliding_window, logits_soft_cap,
                         interpret, sinks=None, attention_chunk=None):
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_seq = block_tables.shape[1]
    ppcb = min(pages_per_compute_block, pages_per_seq)
    pools = (k_pages, v_pages, *scales)
    # [group, head_dim] tiles equal the array's last two dims, so any group is
    # a legal Mosaic block; q is tiny in decode, so compute in float32.
    q4 = q.reshape(num_seqs, num_kv_heads, group, head_dim).astype(jnp.float32)
    qo_spec = pl.BlockSpec((None, None, group, head_dim),
                           lambda s, h, *_: (s, h, 0, 0))
    bufs = [pltpu.VMEM((2, ppcb) + x.shape[2:], x.dtype) for x in (k_pages, v_pages)]
    if scales:
        bufs.append(tpu_scale_buffer(ppcb, block_size))
    kernel = functools.partial(_tpu_kernel, pages_per_seq=pages_per_seq, scale=scale,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               has_sinks=sinks is not None, attention_chunk=attention_chunk)
    sink_inputs, sink_specs = (), []
    if sinks is not None:
        sink_inputs = (sink_rows(sinks, num_kv_heads, group, lanes=128),)
        sink_specs = [pl.BlockSpec((None, group, 128), lambda s, h, *_: (h, 0, 0))]
    out = tpu_call(
        kernel, grid=(num_seqs, num_kv_heads), num_scalar_prefetch=2,
        in_specs=[qo_spec] + sink_specs + [pl.BlockSpec(memory_space=pl.ANY)] * len(pools),
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct(q4.shape, jnp.float32),
        scratch_shapes=bufs + [pltpu.SemaphoreType.DMA((len(pools), 2))],
        interpret=interpret, name="paged_attention_tpu",
    )(seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1),
      q4, *sink_inputs, *pools)
    return out.reshape(q.shape).astype(q.dtype)


# ---------------------------------------------------------------------------
# GPU (Triton) kernel.
# ---------------------------------------------------------------------------


def _gpu_kernel(
    q_ref,  # [group_padded, head_dim]
    *refs,  # [sinks_ref (with sinks)], k_ref [num_blocks, block_size, head_dim] (this kv head),
            # v_ref (same), [words_ref ([num_word_blocks, block_size], this kv head; 8-bit pages only)],
            # then: block_table_ref [pages_per_seq_padded] (this sequence),
            # seq_len_ref [] (this sequence), o_ref [group_padded, head_dim]
    keys: int,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    has_sinks: bool = False,
    attention_chunk: int | None = None,
):
    # sinks_ref: [group_padded] (this kv head)
    sinks = None
    if has_sinks:
        sinks, refs = refs[0][...][:, None], refs[1:]
    k_ref, v_ref, *refs = refs
    words_ref, (block_table_ref, seq_len_ref, o_ref) = refs[:-3], refs[-3:]
    group, head_dim = q_ref.shape
    block_size = k_ref.shape[1]
    seq_len = seq_len_ref[()]
    kv_start = window_start(seq_len - 1, sliding_window, attention_chunk)
    num_steps, locate = gpu_steps(kv_start, seq_len, block_size, keys)
    q = q_ref[...]

    def table(page, n):
        return block_table_ref[page] if n is None else block_table_ref[pl.ds(page, n)]

    def body(step, carry):
        page, row0, start = locate(step)
        k, v, *words = gpu_block((k_ref, v_ref, *words_ref), table, page, row0, keys, head_dim)
        if words:  # 8-bit pages: cast (exact) to the query dtype
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        cols = start + lax.broadcasted_iota(jnp.int32, (group, keys), 1)
        mask = (cols < seq_len) & (cols >= kv_start)
        v = jnp.where((start + jnp.arange(keys) < seq_len)[:, None], v, 0)
        scale_rows = None
        if words:
            scale_rows = unpack_scale_row(words[0], start + jnp.arange(keys)[None, :], seq_len)
        return attend_block(carry, q, k, v, mask, scale, scale_rows, logits_soft_cap)

    carry = lax.fori_loop(0, num_steps, body, init_softmax_carry(group, head_dim, sinks))
    o_ref[...] = finalize_softmax(carry).astype(o_ref.dtype)


def _paged_attention_gpu(q, k_pages, v_pages, block_tables, seq_lens, *scales,
                         scale, pages_per_compute_block, sliding_window, logits_soft_cap,
                         interpret, sinks=None, attention_chunk=None, num_warps=4, num_stages=2):
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_seq = block_tables.shape[1]
    ppcb = next_power_of_two(min(pages_per_compute_block, pages_per_seq))
    itemsize = k_pages.dtype.itemsize
    keys = gpu_keys_per_step(head_dim, itemsize, block_size, ppcb, num_stages)
    # Triton dots need M >= 16 rows and power-of-two tiles: pad the group.
    group_p = max(16, next_power_of_two(group))
    q4 = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_p - group), (0, 0)))
    tables = gpu_table(block_tables, max(1, keys // block_size))
    qo_spec = pl.BlockSpec((None, None, group_p, head_dim),
                           lambda s, h: (s, h, 0, 0))
    pool_specs, words = gpu_pool_specs(k_pages, scales, lambda s, h: h)
    kernel = functools.partial(_gpu_kernel, keys=keys, scale=scale, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, has_sinks=sinks is not None,
                               attention_chunk=attention_chunk)
    sink_inputs, sink_specs = (), []
    if sinks is not None:
        sink_inputs = (sink_rows(sinks, num_kv_heads, group_p, group_p),)
        sink_specs = [pl.BlockSpec((None, group_p), lambda s, h: (h, 0))]
    out = gpu_call(
        kernel, grid=(num_seqs, num_kv_heads),
        in_specs=[qo_spec, *sink_specs, *pool_specs,
                  pl.BlockSpec((None, tables.shape[1]), lambda s, h: (s, 0)),
                  pl.BlockSpec((None,), lambda s, h: (s,))],
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, name="paged_attention_gpu",
    )(q4, *sink_inputs, k_pages, v_pages, *words, tables, seq_lens.astype(jnp.int32))
    return out[:, :, :group].reshape(q.shape)


# ---------------------------------------------------------------------------
# Public entry point.
# ---------------------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=["scale", "pages_per_compute_block", "sliding_window", "logits_soft_cap",
                     "attention_chunk", "backend", "interpret"])
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    pages_per_compute_block: int = 8,
    kv_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    attention_chunk: int | None = None,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention over the paged KV pool.

    Args:
      q: ``[num_seqs, num_q_heads, head_dim]``, one query token per sequence.
      k_pages, v_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
      block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
      seq_lens: int32 ``[num_seqs]``; sequence ``s``'s query sits at position
        ``seq_lens[s] - 1`` and attends to positions ``0 .. seq_lens[s] - 1``.
        A zero length gives a zero output row.
      scale: softmax scale applied to ``q @ k``.
      pages_per_compute_block: pages per online-softmax step (clipped to
        ``max_blocks_per_seq``; rounded up to a power of two on GPU).
      kv_scales: uint32 ``[num_kv_heads, scale_rows, 128]`` with int8/float8_e4m3fn
        pages (``quant.py``), else None.
      sliding_window: None, or the query sees only the last ``sliding_window``
        positions (``j > seq_len - 1 - sliding_window``).
      logits_soft_cap: None, or the scaled logits ``s`` become ``cap * tanh(s / cap)``.
      sinks: None, or float ``[num_q_heads]``: each head's attention sink (gpt-oss), a logit in
        the softmax's denominator that takes no value.
      attention_chunk: None, or the query sees only the keys of its chunk,
        ``j >= (seq_len - 1) // attention_chunk * attention_chunk`` (Llama 4).
      backend: ``None``/``"auto"``, ``"tpu"``, ``"gpu"`` or ``"xla"``; see the
        module docstring.
      interpret: run the Pallas kernel in interpret mode (any host).

    Returns:
      ``[num_seqs, num_q_heads, head_dim]`` in ``q.dtype`` (float32
      accumulation).
    """
    check_attention_shapes(q, k_pages, v_pages, block_tables, seq_lens)
    check_knobs(sliding_window, logits_soft_cap)
    check_sinks(sinks, q.shape[1])
    check_attention_chunk(attention_chunk)
    scales = quant.pools_of(k_pages, v_pages, kv_scales)[2:]
    if pages_per_compute_block < 1:
        raise ValueError(f"{pages_per_compute_block=} must be >= 1")
    knobs = dict(scale=scale, pages_per_compute_block=pages_per_compute_block,
                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    extra = optional_knobs(sinks=sinks, attention_chunk=attention_chunk)
    knobs.update(extra)
    head_dim, block_size = q.shape[-1], k_pages.shape[2]
    impl = dispatch(
        backend, interpret,
        tpu=functools.partial(_paged_attention_tpu, **knobs),
        gpu=(functools.partial(_paged_attention_gpu, **knobs)
             if gpu_supported(head_dim, block_size) else None),
        xla=with_scale_args(jnp_attention.paged_attention_reference, 5, scale=scale,
                            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, **extra))
    return impl(q, k_pages, v_pages, block_tables, seq_lens, *scales)
