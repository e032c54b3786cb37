"""8-bit KV pages: quantize on write, dequantize inside attention.

A quantized layer cache is ``(k_pages, v_pages, k_scales, v_scales)``: pages
``[num_kv_heads, num_blocks, block_size, head_dim]`` in int8 or float8_e4m3fn
and scales ``[num_kv_heads, num_blocks, block_size]`` in ``SCALE_DTYPE``;
the stored row ``x[h, slot]`` stands for ``pages[h, slot] * scales[h, slot]``.
Every array leads with ``[num_kv_heads, num_blocks, block_size]``, so block
copies, swaps and head sharding treat scales as more pages.

Granularity: one scale per (token, kv head). It is what a write produces
(each new token's row is quantized alone: no rescaling of tokens already in a
block, so prefix-cached and copy-on-write blocks stay valid), it adapts to
per-token outliers, and in attention it is one factor per key column: the
kernels multiply the ``q @ k`` logits and the softmax weights by it rather
than dequantizing K/V element-wise.

Scale dtype, bfloat16: 2 bytes per (token, head) next to ``head_dim`` bytes of
8-bit values, so with head_dim 64 a token-head costs 66 bytes against 256 in
float32 (3.88x) and 128 in bfloat16 (1.94x); a float32 scale (68 bytes) would
give only 3.76x. bfloat16 rather than float16 because it has float32's range:
a scale never overflows or flushes to zero whatever the activations' magnitude.
Its 8-bit mantissa costs nothing: values are quantized *with the rounded
scale*, so the only error is the 8-bit rounding of each value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCALE_DTYPE = jnp.bfloat16
# kv_cache_dtype name -> page dtype.
KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# Largest magnitude each page dtype represents (int8 is kept symmetric).
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized(dtype) -> bool:
    """Whether pages of ``dtype`` carry scales."""
    return jnp.dtype(dtype) in _QMAX


def check_quantized(pages, scales):
    """Raises unless ``scales`` (None or a pair) match ``pages`` (a pair)."""
    k_pages, v_pages = pages
    if scales is None:
        if is_quantized(k_pages.dtype):
            raise ValueError(f"{k_pages.dtype} pages need k_scales and v_scales")
        return
    k_scales, v_scales = scales
    if not is_quantized(k_pages.dtype) or v_pages.dtype != k_pages.dtype:
        raise ValueError("k_scales/v_scales are for int8 or float8_e4m3fn pages; "
                         f"got {k_pages.dtype} and {v_pages.dtype}")
    if k_scales.shape != k_pages.shape[:3] or v_scales.shape != k_scales.shape:
        raise ValueError("k_scales and v_scales must both be [num_kv_heads, "
                         f"num_blocks, block_size] = {k_pages.shape[:3]}; got "
                         f"{k_scales.shape} and {v_scales.shape}")


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


def pools_and_rows(k_pages, v_pages, k_new, v_new, k_scales, v_scales):
    """The arrays a KV write updates and the ``[num_tokens, num_kv_heads, ...]``
    rows it writes into them: ``(k_pages, v_pages)`` and the new K/V, or, with
    scales, the four pool arrays and the quantized K/V with their scales."""
    if k_scales is None and v_scales is None:
        check_quantized((k_pages, v_pages), None)
        return (k_pages, v_pages), (k_new, v_new)
    check_quantized((k_pages, v_pages), (k_scales, v_scales))
    (kq, ks), (vq, vs) = (quantize(x, k_pages.dtype) for x in (k_new, v_new))
    return (k_pages, v_pages, k_scales, v_scales), (kq, vq, ks, vs)


def pools_of(k_pages, v_pages, k_scales, v_scales):
    """``(k_pages, v_pages)`` or the four arrays, checked."""
    if k_scales is None and v_scales is None:
        check_quantized((k_pages, v_pages), None)
        return k_pages, v_pages
    check_quantized((k_pages, v_pages), (k_scales, v_scales))
    return k_pages, v_pages, k_scales, v_scales


def bytes_per_row(head_dim: int, dtype) -> int:
    """Bytes one token's K (or V) row of one kv head costs in a pool of
    ``dtype`` pages: ``head_dim`` values, plus the scale of 8-bit pages."""
    row = head_dim * jnp.dtype(dtype).itemsize
    return row + (jnp.dtype(SCALE_DTYPE).itemsize if is_quantized(dtype) else 0)


def scales_of(kv_cache) -> dict:
    """``k_scales=``/``v_scales=`` keywords of a layer cache tuple: ``{}`` for
    ``(k_pages, v_pages)``, its last two arrays for ``(k_pages, v_pages,
    k_scales, v_scales)``."""
    return dict(zip(("k_scales", "v_scales"), kv_cache[2:]))
