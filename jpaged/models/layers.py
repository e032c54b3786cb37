"""Pieces every jpaged model shares: norms, activations, linear layers, rotary positions, the layer
loop, logits."""
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.model_config import ModelConfig
from pallas_kernels import cpu

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),          # tanh approximation
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation_function {name!r} is not supported; "
                         f"supported: {sorted(ACTIVATIONS)}") from None


class LayerNorm(nnx.Module):
    """``torch.nn.LayerNorm`` (statistics in float32); ``affine=False`` has no weight or bias."""

    def __init__(self, dim: int, eps: float, dtype, affine: bool = True):
        self.weight = nnx.Param(jnp.ones((dim,), dtype)) if affine else None
        self.bias = nnx.Param(jnp.zeros((dim,), dtype)) if affine else None
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        if self.weight is None:
            return y
        return y * self.weight[...] + self.bias[...]


class RMSNorm(nnx.Module):
    """RMS norm over the last axis (statistics in float32). ``unit_offset`` (Gemma): the weight is
    stored as an offset from 1 and applied in float32, ``x * (1 + w)``."""

    def __init__(self, dim: int, eps: float, dtype, unit_offset: bool = False):
        self.weight = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), dtype))
        self.eps, self.unit_offset = eps, unit_offset

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)


def soft_cap(x, cap: float | None):
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping); ``x`` itself when ``cap`` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """`jax.lax.dot_general` for the `linear` layers, except that a float32 ``[M, K] @ [K, N]`` with
    few rows where `pallas_kernels.cpu.runs` says so (a decode step, or the logits of a step's
    sampled rows) runs the C++ `pallas_kernels.cpu.matmul`, which streams the weight once."""
    ((lhs_contract, rhs_contract), batch) = dimension_numbers
    if (lhs_contract == (1,) and rhs_contract == (0,) and batch == ((), ())
            and preferred_element_type in (None, jnp.float32) and kwargs.get("out_sharding") is None
            and cpu.runs("matmul", lhs, rhs)):
        return cpu.matmul(lhs, rhs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)


def linear(din, dout, bias, dtype, rngs):
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, dot_general=dot_general, rngs=rngs)


class PackedKernel(nnx.Variable):
    """A linear layer's kernel packed for the C++ matmul (`pallas_kernels.cpu.pack_weight`): a
    copy made from the kernel, never a parameter (`jpaged.runner.packed_weights`)."""


def project(x, *layers):
    """``tuple(layer(x) for layer in layers)``: several linear layers of one input (q, k and v; gate
    and up). Where their matmuls run the C++ few-row kernel, they run as one call (one hand-off to
    the thread pool for all the weights), from the layers' packed copies where each has one
    (``packed_kernel``); layers the loader swapped for quantized ones run alone."""
    if all(type(layer) is nnx.Linear for layer in layers):
        kernels = [layer.kernel[...] for layer in layers]
        packed = [getattr(layer, "packed_kernel", None) for layer in layers]
        outs = None
        if all(p is not None for p in packed):  # measured as it would run: from the copies
            if cpu.runs("matmul_packed", x, *kernels):
                outs = cpu.matmuls_packed(x, [p[...] for p in packed])
        elif cpu.runs("matmul", x, *kernels):
            outs = cpu.matmuls(x, kernels)
        if outs is not None:
            return tuple(out if layer.bias is None else out + layer.bias[...] for out, layer in zip(outs, layers))
    return tuple(layer(x) for layer in layers)


def run_layers(layers, x, kv_caches, *args, kv_layout=None):
    """``x`` through each layer with its KV cache: ``layer(x, *args, kv_cache) -> (x, kv_cache)`` is
    called as ``layer(x, *args[:-1], kv_cache, args[-1])`` (the metadata comes last).

    ``kv_layout`` (default: the metadata's, else one pool tensor per layer): (group, tensor) per
    layer: the layer reads and updates ``kv_caches[tensor]`` (layers of different KV-cache groups
    may share a tensor) with its group's metadata (`AttentionMetadata.for_group`)."""
    *extra, md = args
    layout = kv_layout or getattr(md, "kv_layout", None) or [(0, i) for i in range(len(layers))]
    caches = list(kv_caches)
    for layer, (group, tensor) in zip(layers, layout):
        x, caches[tensor] = layer(x, *extra, caches[tensor], md.for_group(group) if group else md)
    return x, caches


def tied_or_head_logits(embed: nnx.Embed, lm_head, hidden):
    """float32 logits from ``lm_head`` (through `project`: the C++ matmul where it serves), or from
    the embedding table when the two are tied (None): the C++ packed matmul on the table's packed
    copy (``packed_kernel``, `jpaged.runner.packed_weights`) or `pallas_kernels.cpu.matmul_t` on the
    table as it lies, where `pallas_kernels.cpu.runs` says so, else XLA's."""
    if lm_head is not None:
        return project(hidden, lm_head)[0].astype(jnp.float32)
    table = embed.embedding[...]
    packed = getattr(embed, "packed_kernel", None)
    if packed is not None and cpu.runs("matmul_t_packed", hidden, table):
        return cpu.matmuls_packed(hidden, [packed[...]])[0]
    if hidden.ndim == 2 and cpu.runs("matmul_t", hidden, table):
        return cpu.matmul_t(hidden, table)
    return embed.attend(hidden).astype(jnp.float32)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies as transformers computes them (default, linear and llama3 scaling);
    ``local``: those of the sliding-window layers (their own base, ``local_rope_theta``, no scaling)."""
    dim = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        with np.errstate(divide="ignore", invalid="ignore"):  # high == low (Llama 4 Scout): no medium band
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3 are)")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude factor ``0.1 * mscale * ln(scale) + 1`` (1 when the context is not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_frequencies(scaling: dict, dim: int, base: float, original: int, factor: float) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dim / 2], attention factor) of YaRN rope scaling as transformers computes
    them: frequencies interpolated by ``factor`` below the ``beta_slow .. beta_fast`` rotation band
    and kept above it (``original``: the pre-training context), and cos/sin scaled by the attention
    factor (``0.1 * ln(factor) + 1``, or the ``mscale`` / ``mscale_all_dim`` ratio, unless the
    scaling gives one)."""
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def yarn_rope(config: ModelConfig) -> tuple[np.ndarray, float]:
    """`yarn_frequencies` of a config's ``rope_scaling`` / ``rope_parameters`` (``rope_type: yarn``)
    over its whole head_dim."""
    scaling = config.rope_scaling or {}
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_scaling.original_max_position_embeddings: YaRN needs it")
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return yarn_frequencies(scaling, config.head_dim, config.rope_theta, original, factor)


def rope_cos_sin(inv_freq, positions):
    """cos and sin ``[T, head_dim]`` of each position (rotate-half layout, as `apply_rope` takes)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [T, H, D]; cos/sin [T, R] in the rotate-half convention of transformers, over the first R
    dimensions of each head (R < D: partial rotary, the rest pass through)."""
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos[:, None] + rotated.astype(jnp.float32) * sin[:, None]
    return out.astype(x.dtype)
