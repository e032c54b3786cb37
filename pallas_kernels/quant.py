"""8-bit KV pages: quantize on write, dequantize inside attention.

A quantized layer cache is ``(k_pages, v_pages, kv_scales)``: pages ``[num_kv_heads, num_blocks,
block_size, head_dim]`` in int8 or float8_e4m3fn, and the scales of both in one uint32 array
``kv_scales [num_kv_heads, scale_rows, 128]`` (``scale_rows``: ``num_blocks * block_size / 128``
rounded up to a multiple of 8). Slot ``s`` of head ``h`` has one 32-bit word at ``kv_scales[h, s
// 128, s % 128]``: its K scale's bfloat16 bits in the low half, its V scale's in the high half
(``pack_scales``). The stored row ``x[h, slot]`` stands for ``pages[h, slot] * scale``.

Why this layout: a TPU DMA moves whole tiles of 16- and 8-bit arrays but single rows of 32-bit
ones, and XLA:TPU keeps an array in the row-major order a Mosaic kernel needs only when that
order pads it least (otherwise it picks another dimension order, and every kernel call copies the
array into row-major order and back). Scales ``[heads, blocks, block_size]`` failed both: one
block's bfloat16 scales are a 1-row slice, and a minor dimension of 16 made XLA transpose the
array. Here one DMA of a 128-word row brings a page's K and V scales; the array fills its (8, 128)
tiles (``scale_rows`` is a multiple of 8), so it is dense (4 bytes per (token, head): 2 per scale,
as before) and row-major; its head axis leads, so it shards with the pages. The kernels move a
page's words to its key columns with a lane rotation (``pallas/common.py``). Block ids map to
words through ``block_words``; ``block_size`` must divide 128 or be a multiple of it.

Granularity: one scale per (token, kv head). It is what a write produces (each new token's row is
quantized alone: no rescaling of tokens already in a block, so prefix-cached and copy-on-write
blocks stay valid), it adapts to per-token outliers, and in attention it is one factor per key
column: the kernels multiply the ``q @ k`` logits and the softmax weights by it rather than
dequantizing K/V element-wise.

Scale dtype, bfloat16: 2 bytes per (token, head) next to ``head_dim`` bytes of 8-bit values, so
with head_dim 64 a token-head costs 66 bytes against 256 in float32 (3.88x) and 128 in bfloat16
(1.94x); a float32 scale (68 bytes) would give only 3.76x. bfloat16 rather than float16 because
it has float32's range: a scale never overflows or flushes to zero whatever the activations'
magnitude. Its 8-bit mantissa costs nothing: values are quantized *with the rounded scale*, so
the only error is the 8-bit rounding of each value. A bfloat16 is the top half of a float32, so
unpacking a word is a shift and a mask.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.shapes import cdiv

SCALE_DTYPE = jnp.bfloat16
SCALE_WORD_DTYPE = jnp.uint32
LANES = 128  # scale words per row of ``kv_scales``
# kv_cache_dtype name -> page dtype.
KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# Largest magnitude each page dtype represents (int8 is kept symmetric).
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized(dtype) -> bool:
    """Whether pages of ``dtype`` carry scales."""
    return jnp.dtype(dtype) in _QMAX


def scales_shape(num_kv_heads: int, num_blocks: int, block_size: int) -> tuple[int, int, int]:
    """Shape of ``kv_scales`` for a pool of ``num_blocks`` blocks."""
    rows = cdiv(num_blocks * block_size, LANES)
    return num_kv_heads, cdiv(rows, 8) * 8, LANES


def check_block_size(block_size: int):
    if LANES % block_size and block_size % LANES:
        raise ValueError(f"8-bit pages need a block_size that divides {LANES} or is a multiple of "
                         f"it; got {block_size}")


def check_quantized(k_pages, v_pages, kv_scales):
    """Raises unless ``kv_scales`` (or None) match the pages."""
    if kv_scales is None:
        if is_quantized(k_pages.dtype):
            raise ValueError(f"{k_pages.dtype} pages need kv_scales")
        return
    if not is_quantized(k_pages.dtype) or v_pages.dtype != k_pages.dtype:
        raise ValueError("kv_scales are for int8 or float8_e4m3fn pages; got "
                         f"{k_pages.dtype} and {v_pages.dtype}")
    check_block_size(k_pages.shape[2])
    want = scales_shape(*k_pages.shape[:3])
    if kv_scales.shape != want or kv_scales.dtype != SCALE_WORD_DTYPE:
        raise ValueError(f"kv_scales must be uint32 [num_kv_heads, scale_rows, {LANES}] = {want} "
                         f"(quant.scales_shape); got {kv_scales.dtype} {kv_scales.shape}")


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Per-row symmetric quantization of ``x [..., head_dim]``.

    Returns ``(values [..., head_dim] in dtype, scales [...] in SCALE_DTYPE)``
    with ``scale = max|x| / qmax`` (127 for int8, 448 for float8_e4m3fn),
    rounded to ``SCALE_DTYPE`` before it divides ``x``. A zero row gets scale 0
    and zero values.
    """
    dtype = jnp.dtype(dtype)
    qmax = _QMAX[dtype]
    x = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(x), axis=-1) / qmax).astype(SCALE_DTYPE)
    s = scale.astype(jnp.float32)[..., None]
    y = jnp.clip(x / jnp.where(s > 0, s, 1.0), -qmax, qmax)
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize(values: jax.Array, scales: jax.Array,
               dtype=jnp.float32) -> jax.Array:
    """``values [..., head_dim] * scales [...]`` in ``dtype``."""
    return (values.astype(jnp.float32)
            * scales.astype(jnp.float32)[..., None]).astype(dtype)


def pack_scales(k_scales: jax.Array, v_scales: jax.Array) -> jax.Array:
    """One uint32 word per pair of bfloat16 scales: K in the low half, V in the high half."""
    bits = lambda s: lax.bitcast_convert_type(s.astype(SCALE_DTYPE), jnp.uint16).astype(jnp.uint32)  # noqa: E731
    return bits(k_scales) | (bits(v_scales) << 16)


def unpack_scales(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(k_scales, v_scales)`` of ``pack_scales`` words, as float32 (exact)."""
    words = words.astype(jnp.uint32)
    k = lax.bitcast_convert_type(words << 16, jnp.float32)
    v = lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32)
    return k, v


def block_words(kv_scales: jax.Array, block_size: int) -> jax.Array:
    """``kv_scales`` seen as ``[num_kv_heads, num_word_blocks, block_size]``: entry ``[h, b, i]``
    is the word of slot ``b * block_size + i`` (``num_word_blocks >= num_blocks``)."""
    return kv_scales.reshape(kv_scales.shape[0], -1, block_size)


def pools_and_rows(k_pages, v_pages, k_new, v_new, kv_scales):
    """The arrays a KV write updates and the ``[num_tokens, num_kv_heads, ...]`` rows it writes
    into them: ``(k_pages, v_pages)`` and the new K/V, or, with scales, also ``kv_scales`` and the
    new rows' packed scale words ``[num_tokens, num_kv_heads]``."""
    check_quantized(k_pages, v_pages, kv_scales)
    if kv_scales is None:
        return (k_pages, v_pages), (k_new, v_new)
    (kq, ks), (vq, vs) = (quantize(x, k_pages.dtype) for x in (k_new, v_new))
    return (k_pages, v_pages, kv_scales), (kq, vq, pack_scales(ks, vs))


def pools_of(k_pages, v_pages, kv_scales):
    """``(k_pages, v_pages)`` or the three arrays, checked."""
    check_quantized(k_pages, v_pages, kv_scales)
    return (k_pages, v_pages) if kv_scales is None else (k_pages, v_pages, kv_scales)


def bytes_per_row(head_dim: int, dtype) -> int:
    """Bytes one token's K (or V) row of one kv head costs in a pool of
    ``dtype`` pages: ``head_dim`` values, plus the scale of 8-bit pages."""
    row = head_dim * jnp.dtype(dtype).itemsize
    return row + (jnp.dtype(SCALE_DTYPE).itemsize if is_quantized(dtype) else 0)


def scales_of(kv_cache) -> dict:
    """``kv_scales=`` keyword of a layer cache tuple: ``{}`` for ``(k_pages, v_pages)``, its third
    array for ``(k_pages, v_pages, kv_scales)``."""
    return dict(kv_scales=kv_cache[2]) if len(kv_cache) > 2 else {}
