"""Weight-only quantized layers: integer weights in memory, dequantized inside the jitted matmul.

Two storage schemes, each with a linear layer and a token-embedding table (the table doubles as
the output projection of tied models, through ``attend``):

* ``int8`` (`QuantizedLinear`, `QuantizedEmbed`): symmetric int8 with one float32 scale per output
  channel, made at load time from float weights by `quantize_int8`. The kernel keeps
  ``nnx.Linear``'s ``[in, out]`` layout and name and the table ``nnx.Embed``'s ``[vocab, hidden]``,
  so the tensor-parallel rules that split them by path still apply; a linear's ``scale`` ``[out]``
  splits with the output channels, an embedding's per-row ``scale`` ``[vocab]`` is replicated.
* GGUF blocks (`GGUFLinear`, `GGUFEmbed`): llama.cpp's Q8_0 / Q4_0 / Q4_1 kept as stored, 32
  consecutive input elements per block sharing a float16 scale (and, for Q4_1, a float16 minimum).
  Laid out block-major, ``qweight [in / 32, 32 | 16, out]`` (int8 for Q8_0, two 4-bit values per
  uint8 for Q4_*: the low nibbles are the block's elements 0..15, the high ones 16..31),
  ``scales`` / ``mins`` ``[in / 32, out]``: a split on the input axis is a split on whole blocks.

The modules are not built by the model classes: the loader (`jpaged.loading.model_loader.build_model`) swaps
them in for the ``nnx.Linear`` / ``nnx.Embed`` a weight is meant for, so every model family gets
them without its code knowing.

The matmul (`weight_matmul`) dequantizes a weight to a temporary in the activations' dtype and
runs an ordinary matmul. The temporary is made to depend on the layer's input, so XLA cannot
dequantize every weight at the start of the step: one layer's temporary at a time, the same
buffer reused (on XLA:CPU, hoisted conversions of all weights measured several times slower than
the float step, and the temporaries cost a float copy of the model in memory).
"""
import jax.numpy as jnp
import numpy as np
from flax import nnx

GGUF_BLOCK = 32
GGUF_KINDS = ("Q8_0", "Q4_0", "Q4_1")


def weight_matmul(x, w):
    """``x [..., in] @ w [in, out]`` for a weight ``w`` that is an expression of stored integers
    (traced, not yet computed): ``w`` is computed in ``x``'s dtype right before the matmul.

    The term added to ``w`` is always 0 but reads ``x``: it orders the dequantization after the
    previous layer (never NaN: ``x == x`` is a comparison, not arithmetic on ``x``)."""
    first = x.reshape(-1)[0]
    after_input = (first == first).astype(x.dtype) * 0
    return x @ (w.astype(x.dtype) + after_input)


# --------------------------------------------------------------------------- int8, per output channel


def quantize_int8(w: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8, scale float32)`` with ``w ~= q * scale``: symmetric, one scale per slice along
    every axis but ``axis`` (the reduced one: ``axis=0`` of a kernel ``[in, out]`` gives one scale
    per output channel). Values round to nearest in [-127, 127]; an all-zero channel gets scale 1."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=axis)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / np.expand_dims(scale, axis)), -127, 127).astype(np.int8)
    return q, scale


def _check_int8_scale(what: str, values, scale, axis: int) -> None:
    """ValueError unless ``values`` is 2-D with one ``scale`` per index of its ``axis``."""
    if values.ndim != 2 or scale.shape != (values.shape[axis],):
        raise ValueError(f"{what} {values.shape} needs a scale of shape ({values.shape[axis]},), got {scale.shape}")


class QuantizedLinear(nnx.Module):
    """``y = (x @ kernel) * scale + bias`` with ``kernel`` int8 ``[in, out]`` and ``scale`` float32
    ``[out]``; the matmul runs in ``x``'s dtype (the int8 kernel is converted inside the step)."""

    def __init__(self, kernel, scale, bias: nnx.Param | None = None):
        _check_int8_scale("QuantizedLinear: kernel", kernel, scale, axis=1)
        self.kernel = nnx.Param(kernel)
        self.scale = nnx.Param(scale)
        self.bias = bias

    def __call__(self, x):
        y = weight_matmul(x, self.kernel[...]) * self.scale[...].astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]


class QuantizedEmbed(nnx.Module):
    """A token table ``embedding`` int8 ``[vocab, hidden]`` with one float32 ``scale`` per row:
    ``__call__(ids)`` looks rows up, ``attend(h)`` is ``h @ table.T`` (tied logits)."""

    def __init__(self, embedding, scale, dtype):
        _check_int8_scale("QuantizedEmbed: table", embedding, scale, axis=0)
        self.embedding = nnx.Param(embedding)
        self.scale = nnx.Param(scale)
        self.dtype = dtype

    def __call__(self, ids):
        rows = self.embedding[...][ids].astype(jnp.float32) * self.scale[...][ids][..., None]
        return rows.astype(self.dtype)

    def attend(self, h):
        return weight_matmul(h, self.embedding[...].T) * self.scale[...].astype(h.dtype)


# --------------------------------------------------------------------------- GGUF blocks


def dequantize_blocks(kind: str, qweight, scales, mins=None, dtype=jnp.float32):
    """``[blocks * 32, ...]`` weights from GGUF blocks ``qweight [blocks, 32 | 16, ...]``, ``scales``
    / ``mins`` ``[blocks, ...]`` (the trailing axes are the output channels, any number of them)."""
    if kind == "Q8_0":
        values = qweight.astype(jnp.float32)
    else:  # two 4-bit values per byte: low nibble = element j, high nibble = element j + 16
        values = jnp.concatenate([qweight & 0xF, qweight >> 4], axis=1).astype(jnp.float32)
    d = scales.astype(jnp.float32)[:, None]
    if kind == "Q4_0":
        w = (values - 8.0) * d
    elif kind == "Q4_1":
        w = values * d + mins.astype(jnp.float32)[:, None]
    else:
        w = values * d
    return w.reshape(-1, *w.shape[2:]).astype(dtype)


class GGUFBlockParams(nnx.Module):
    """Storage shared by `GGUFLinear` and `GGUFEmbed`: ``kind`` (Q8_0 / Q4_0 / Q4_1), ``qweight``,
    ``scales`` and, for Q4_1, ``mins`` (None otherwise), laid out as the module docstring says."""

    def __init__(self, kind: str, qweight, scales, mins=None):
        if kind not in GGUF_KINDS:
            raise ValueError(f"GGUF block type {kind!r} is not kept quantized (supported: {GGUF_KINDS})")
        per_block = GGUF_BLOCK if kind == "Q8_0" else GGUF_BLOCK // 2
        if (qweight.ndim != 3 or qweight.shape[1] != per_block or scales.shape != (qweight.shape[0], qweight.shape[2])
                or (mins is None) != (kind != "Q4_1") or (mins is not None and mins.shape != scales.shape)):
            raise ValueError(f"{kind} blocks: qweight {qweight.shape}, scales {scales.shape}, mins "
                             f"{None if mins is None else mins.shape} do not fit [blocks, {per_block}, out] / "
                             "[blocks, out]")
        self.kind = kind
        self.qweight = nnx.Param(qweight)
        self.scales = nnx.Param(scales)
        self.mins = None if mins is None else nnx.Param(mins)

    def _weight(self, dtype=jnp.float32, columns=None):
        """The dequantized ``[in, out]`` weight, or only the output ``columns`` (``[in, len]``)."""
        q, s, m = self.qweight[...], self.scales[...], None if self.mins is None else self.mins[...]
        if columns is not None:
            q, s, m = q[..., columns], s[..., columns], None if m is None else m[..., columns]
        return dequantize_blocks(self.kind, q, s, m, dtype)


class GGUFLinear(GGUFBlockParams):
    """``y = x @ W + bias`` with ``W [in, out]`` kept in GGUF blocks along ``in``."""

    def __init__(self, kind: str, qweight, scales, mins=None, bias: nnx.Param | None = None):
        super().__init__(kind, qweight, scales, mins)
        self.bias = bias

    def __call__(self, x):
        y = weight_matmul(x, self._weight())
        return y if self.bias is None else y + self.bias[...]


class GGUFEmbed(GGUFBlockParams):
    """A token table kept in GGUF blocks along ``hidden`` (stored as ``[hidden, vocab]`` blocks, the
    layout of a linear from hidden to vocab): rows are looked up by column, ``attend`` is the matmul."""

    def __init__(self, kind: str, qweight, scales, mins=None, dtype=jnp.float32):
        super().__init__(kind, qweight, scales, mins)
        self.dtype = dtype

    def __call__(self, ids):
        flat = ids.reshape(-1)
        return self._weight(self.dtype, flat).T.reshape(*ids.shape, -1)

    def attend(self, h):
        return weight_matmul(h, self._weight())


QUANTIZED_MODULES = (QuantizedLinear, QuantizedEmbed, GGUFLinear, GGUFEmbed)
