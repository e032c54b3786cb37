"""MXFP4 (OCP microscaling FP4) weights as the gpt-oss checkpoints store their experts, decoded on
the host.

A tensor ``W [..., rows, cols]`` is stored as ``blocks`` uint8 ``[..., rows, cols / 32, 16]`` (two
FP4 E2M1 codes a byte, the low nibble first) and ``scales`` uint8 ``[..., rows, cols / 32]`` (an
E8M0 power of two per 32 values, biased by 127). The released checkpoints hold each expert
weight as ``[E, out, in]`` this way; `dequantize_mxfp4` returns it as ``[E, in, out]``, the
layout of transformers' dequantized parameters (and of jpaged's stacked experts).
"""
import numpy as np

# E2M1 code -> value: sign bit 3, exponent bits 2..1, mantissa bit 0
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[E, cols, rows]`` (the last two axes swapped) from ``blocks [E, rows, G, 16]`` and
    ``scales [E, rows, G]``, ``cols = G * 32``; a ValueError when the shapes do not pair up."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: expected [..., rows, G, 16] "
                         "and [..., rows, G]")
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    out = values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)
    return np.swapaxes(out, -1, -2)
