"""The Pallas MLA decode kernel: one latent-space query per sequence, all heads at once.

Each program reads its sequence's latent pages through the block table once and attends every
head to them (the heads are the rows of one ``[num_heads, W/2]`` tile pair), with an online
softmax. The row's two halves stay in their page tensors: a score is ``q[:, :W/2] . k_half +
q[:, W/2:] . v_half``, and the output keeps both halves' weighted sums, of which the first
``kv_lora_rank`` values are returned; no concatenation happens inside a kernel.

Backends (``backend=``, as `pallas_kernels.paged_attention`):
  * ``"tpu"``: Mosaic. Grid ``(num_seqs, max_blocks_per_seq)``, the block axis sequential; the
    block tables and ``seq_lens`` are scalar-prefetch operands and the page BlockSpecs index the
    pool by block id (Pallas pipelines the next page's copy behind the current one). Blocks past a
    sequence's end repeat its last block id (no new copy) and skip their compute. Page tiles are
    ``[block_size, W/2]``, the array's full last dim.
  * ``"gpu"``: Triton. Grid ``(num_seqs, heads / GPU_HEAD_TILE)``: a program attends 16 heads and
    loops over its sequence's rows ``GPU_KEYS`` at a time, loading them by block id (so each page
    is read once per 16 heads, from L2 after the first; whole-head tiles of 128 heads x 256 values
    would pass the shared memory). Triton needs power-of-two tiles: ``W/2`` and ``block_size``
    powers of two. Other shapes (DeepSeek-V3's ``W/2 = 288``) run the jnp kernel in auto mode.
  * ``"xla"``: the jnp kernel (`reference.mla_paged_decode_reference`).
  * ``None``/``"auto"``: the kernel of the platform being lowered for (``lax.platform_dependent``);
    with ``interpret=True``, the TPU kernel interpreted on any host.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_mla.reference import mla_paged_decode_reference
from pallas_kernels.pallas.common import dispatch, gpu_call, gpu_supported, tpu_call
from pallas_kernels.shapes import DEFAULT_MASK_VALUE


def _online_step(carry, logits, k, v, mask):
    """One online-softmax update with the values' two halves ``k``, ``v`` ``[t, W/2]`` (the
    weights cast to their dtype for the products, float32 accumulation)."""
    m_prev, l_prev, acc_k, acc_v = carry
    logits = jnp.where(mask, logits, DEFAULT_MASK_VALUE)
    m = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    alpha = jnp.exp(m_prev - m)
    l = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc_k = alpha * acc_k + jnp.dot(p.astype(k.dtype), k, preferred_element_type=jnp.float32)
    acc_v = alpha * acc_v + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, l, acc_k, acc_v


def _scores(q_k, q_v, k, v, scale):
    dims = (((1,), (1,)), ((), ()))
    return (lax.dot_general(q_k, k, dims, preferred_element_type=jnp.float32)
            + lax.dot_general(q_v, v, dims, preferred_element_type=jnp.float32)) * scale


def _normalized(l, acc):
    return jnp.where(l > 0.0, acc / jnp.where(l > 0.0, l, 1.0), 0.0)


# ---------------------------------------------------------------------------
# TPU (Mosaic).
# ---------------------------------------------------------------------------


def _vmem(shape):
    return pltpu.VMEM(shape, jnp.float32)


def _tpu_kernel(seq_lens_ref, tables_ref, qk_ref, qv_ref, k_ref, v_ref, ok_ref, ov_ref,
                m_ref, l_ref, acck_ref, accv_ref, *, scale: float):
    s, j = pl.program_id(0), pl.program_id(1)
    block_size = k_ref.shape[0]
    seq_len = seq_lens_ref[s]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acck_ref[...] = jnp.zeros(acck_ref.shape, jnp.float32)
        accv_ref[...] = jnp.zeros(accv_ref.shape, jnp.float32)

    @pl.when(j * block_size < seq_len)
    def _():
        k, v = k_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32)
        logits = _scores(qk_ref[...], qv_ref[...], k, v, scale)
        cols = j * block_size + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        carry = _online_step((m_ref[...], l_ref[...], acck_ref[...], accv_ref[...]), logits, k, v, cols < seq_len)
        m_ref[...], l_ref[...], acck_ref[...], accv_ref[...] = carry

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        ok_ref[...] = _normalized(l_ref[...], acck_ref[...]).astype(ok_ref.dtype)
        ov_ref[...] = _normalized(l_ref[...], accv_ref[...]).astype(ov_ref.dtype)


def _decode_tpu(q_k, q_v, k_pages, v_pages, block_tables, seq_lens, *, scale, interpret):
    num_seqs, heads, half = q_k.shape
    _, _, block_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]

    def page(s, j, lens, tables):  # the sequence's last used block past its end: no new copy
        last = jnp.maximum(pl.cdiv(lens[s], block_size) - 1, 0)
        return 0, tables[s * pages_per_seq + jnp.minimum(j, last)], 0, 0

    q_spec = pl.BlockSpec((None, heads, half), lambda s, j, *_: (s, 0, 0))
    page_spec = pl.BlockSpec((None, None, block_size, half), page)
    out_shape = jax.ShapeDtypeStruct((num_seqs, heads, half), jnp.float32)
    return tpu_call(
        functools.partial(_tpu_kernel, scale=scale), grid=(num_seqs, pages_per_seq), num_scalar_prefetch=2,
        in_specs=[q_spec, q_spec, page_spec, page_spec], out_specs=[q_spec, q_spec],
        out_shape=[out_shape, out_shape],
        scratch_shapes=[_vmem((heads, 1)), _vmem((heads, 1)), _vmem((heads, half)),
                        _vmem((heads, half))],
        parallel=False, interpret=interpret, name="mla_paged_decode_tpu",
    )(seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), q_k.astype(jnp.float32),
      q_v.astype(jnp.float32), k_pages, v_pages)


# ---------------------------------------------------------------------------
# GPU (Triton).
# ---------------------------------------------------------------------------


GPU_HEAD_TILE = 16  # query heads per Triton program (the fewest a Triton dot takes)
GPU_KEYS = 16       # latent rows per online-softmax step of a Triton program (part of a block)


def _gpu_kernel(qk_ref, qv_ref, k_ref, v_ref, table_ref, seq_len_ref, ok_ref, ov_ref, *, scale: float, keys: int):
    heads, half = qk_ref.shape
    block_size = k_ref.shape[1]
    seq_len = seq_len_ref[()]
    q_k, q_v = qk_ref[...], qv_ref[...]

    def body(j, carry):
        start = j * keys
        block, row0 = table_ref[lax.div(start, block_size)], lax.rem(start, block_size)
        k, v = k_ref[block, pl.ds(row0, keys)], v_ref[block, pl.ds(row0, keys)]
        logits = _scores(q_k, q_v, k, v, scale)
        cols = start + lax.broadcasted_iota(jnp.int32, (heads, keys), 1)
        return _online_step(carry, logits, k, v, cols < seq_len)

    init = (jnp.full((heads, 1), -jnp.inf, jnp.float32), jnp.zeros((heads, 1), jnp.float32),
            jnp.zeros((heads, half), jnp.float32), jnp.zeros((heads, half), jnp.float32))
    _, l, acc_k, acc_v = lax.fori_loop(0, pl.cdiv(seq_len, keys), body, init)
    ok_ref[...] = _normalized(l, acc_k).astype(ok_ref.dtype)
    ov_ref[...] = _normalized(l, acc_v).astype(ov_ref.dtype)


def _decode_gpu(q_k, q_v, k_pages, v_pages, block_tables, seq_lens, *, scale, interpret):
    num_seqs, heads, half = q_k.shape
    _, num_blocks, block_size, _ = k_pages.shape
    tile = GPU_HEAD_TILE
    heads_p = tile * -(-heads // tile)
    keys = min(GPU_KEYS, block_size)
    # queries in the page dtype (the dots' operands match); heads padded to whole tiles
    pad = lambda x: jnp.pad(x.astype(k_pages.dtype), ((0, 0), (0, heads_p - heads), (0, 0)))  # noqa: E731
    q_spec = pl.BlockSpec((None, tile, half), lambda s, h: (s, h, 0))
    page_spec = pl.BlockSpec((None, num_blocks, block_size, half), lambda s, h: (0, 0, 0, 0))
    out_shape = jax.ShapeDtypeStruct((num_seqs, heads_p, half), jnp.float32)
    tables = block_tables.astype(jnp.int32)
    o_k, o_v = gpu_call(
        functools.partial(_gpu_kernel, scale=scale, keys=keys), grid=(num_seqs, heads_p // tile),
        in_specs=[q_spec, q_spec, page_spec, page_spec,
                  pl.BlockSpec((None, tables.shape[1]), lambda s, h: (s, 0)),
                  pl.BlockSpec((None,), lambda s, h: (s,))],
        out_specs=[q_spec, q_spec], out_shape=[out_shape, out_shape],
        interpret=interpret, name="mla_paged_decode_gpu",
    )(pad(q_k), pad(q_v), k_pages, v_pages, tables, seq_lens.astype(jnp.int32))
    return o_k[:, :heads], o_v[:, :heads]


# ---------------------------------------------------------------------------
# Public entry point.
# ---------------------------------------------------------------------------


def _kernel(impl, kv_lora_rank):
    """``impl`` (on q's halves, giving the outputs' halves) as a kernel on ``q [S, H, W]``."""
    def run(q, k_pages, v_pages, block_tables, seq_lens, *, interpret):
        half = k_pages.shape[-1]
        o_k, o_v = impl(q[..., :half], q[..., half:], k_pages, v_pages, block_tables, seq_lens,
                        interpret=interpret)
        return jnp.concatenate([o_k, o_v], axis=-1)[..., :kv_lora_rank].astype(q.dtype)
    return run


@functools.partial(jax.jit, static_argnames=["kv_lora_rank", "scale", "pages_per_compute_block", "backend",
                                             "interpret"])
def mla_paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, kv_lora_rank: int, scale: float,
                     pages_per_compute_block: int | None = None, backend: str | None = None,
                     interpret: bool = False):
    """MLA decode attention over the latent pool.

    Args:
      q: ``[num_seqs, num_heads, W]``, one latent-space query per sequence (`reference`).
      k_pages, v_pages: ``[pool_heads, num_blocks, block_size, W/2]``, the latent rows' halves
        (head 0 is read).
      block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
      seq_lens: int32 ``[num_seqs]``: sequence ``s``'s query sits at ``seq_lens[s] - 1`` and
        attends to rows ``0 .. seq_lens[s] - 1``; 0 gives a zero row.
      kv_lora_rank: the value width at the front of each row.
      scale: softmax scale of ``q . row``.
      pages_per_compute_block: blocks per online-softmax step of the jnp kernel (the Pallas
        kernels step one block at a time).
      backend, interpret: see the module docstring.

    Returns:
      ``[num_seqs, num_heads, kv_lora_rank]`` in ``q.dtype`` (float32 accumulation).
    """
    if q.shape[-1] != 2 * k_pages.shape[-1] or v_pages.shape != k_pages.shape:
        raise ValueError(f"q width {q.shape[-1]} != the latent pool's row width 2 * {k_pages.shape[-1]} "
                         f"(k_pages {k_pages.shape}, v_pages {v_pages.shape})")
    if q.shape[0] != block_tables.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError(f"q {q.shape}, block_tables {block_tables.shape}, seq_lens {seq_lens.shape}: "
                         "one row per sequence")
    half, block_size = k_pages.shape[-1], k_pages.shape[2]
    xla = functools.partial(mla_paged_decode_reference, kv_lora_rank=kv_lora_rank, scale=scale,
                            pages_per_compute_block=pages_per_compute_block)
    impl = dispatch(
        backend, interpret,
        tpu=_kernel(functools.partial(_decode_tpu, scale=scale), kv_lora_rank),
        gpu=(_kernel(functools.partial(_decode_gpu, scale=scale), kv_lora_rank)
             if gpu_supported(half, block_size) else None),
        xla=lambda *args: xla(*args))
    return impl(q, k_pages, v_pages, block_tables, seq_lens)
