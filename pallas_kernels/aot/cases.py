"""The kernel compilations of the AOT sweep: one `KernelCase` per (kernel, dtype, shape, knobs).

Shapes follow a Llama-3-8B layer on one chip (8 KV heads, 32 sequences of up to 4,096 tokens,
256 tokens per ragged step); a case varies the page dtype, head_dim, block_size, the query-head
group and the attention knobs. Query dtype: float32 with float32 pages, bfloat16 otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from pallas_kernels import pool
from pallas_kernels.pallas import copy_blocks, paged_attention, ragged_paged_attention, write_kv

KERNELS = ("paged_attention", "ragged_paged_attention", "write_kv", "copy_blocks")
ATTENTION = KERNELS[:2]
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128)
GROUPS = (1, 2, 4, 8)
# (sliding_window, logits_soft_cap) sets compiled beside the plain kernels: Mistral, Gemma 2.
KNOBS = ((None, None), (4096, None), (4096, 50.0))
# gpt-oss's attention (64 query heads over 8 KV heads of 64, 128-token windows or none) with its sinks
SINK_SHAPES = ((64, 16, 8, 128), (64, 32, 8, None))  # (head_dim, block_size, group, sliding_window)
# Llama 4's chunked attention per chip at tensor parallel 8 (5 query heads over a KV head of 128), chunks shorter
# than the 4,096-token context so that they bind
CHUNK_SHAPES = ((128, 32, 5, 1024),)  # (head_dim, block_size, group, attention_chunk)


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One compilation.

    Attributes:
      kernel: a name of `KERNELS`.
      dtype: page dtype name (``"float32"``, ``"bfloat16"``, ``"int8"``, ``"float8_e4m3fn"``).
      head_dim, block_size: page shape.
      group: query heads per KV head (attention only).
      sliding_window, logits_soft_cap: attention knobs.
      sinks: attention with a sink per query head (gpt-oss), an operand.
      attention_chunk: chunked local attention (Llama 4), a knob.
      num_kv_heads, num_seqs, max_len, num_tokens: problem size.
    """

    kernel: str
    dtype: str
    head_dim: int
    block_size: int
    group: int = 4
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: bool = False
    attention_chunk: int | None = None
    num_kv_heads: int = 8
    num_seqs: int = 32
    max_len: int = 4096
    num_tokens: int = 256

    @property
    def name(self) -> str:
        parts = [self.kernel, self.dtype, f"d{self.head_dim}", f"bs{self.block_size}"]
        if self.kernel in ATTENTION:
            parts.append(f"g{self.group}")
        if self.sliding_window is not None:
            parts.append(f"w{self.sliding_window}")
        if self.logits_soft_cap is not None:
            parts.append(f"cap{self.logits_soft_cap:g}")
        if self.sinks:
            parts.append("sinks")
        if self.attention_chunk is not None:
            parts.append(f"chunk{self.attention_chunk}")
        return "-".join(parts)

    def build(self, backend: str):
        """``(fn, args, donate_argnums)``: the kernel with its knobs bound (``backend=``), its
        arguments as ``jax.ShapeDtypeStruct`` and the arguments a step donates (the pool)."""
        s, i32 = jax.ShapeDtypeStruct, jnp.int32
        pages_per_seq = self.max_len // self.block_size
        num_blocks = self.num_seqs * pages_per_seq // 2 + 1
        layer = [s(shape, dt) for shape, dt in pool.layer_arrays(
            self.num_kv_heads, num_blocks, self.block_size, self.head_dim, self.dtype)]
        quantized = len(layer) == 3
        q_dtype = jnp.float32 if self.dtype == "float32" else jnp.bfloat16
        hq = self.num_kv_heads * self.group
        tables, lens = s((self.num_seqs, pages_per_seq), i32), s((self.num_seqs,), i32)
        knobs = dict(backend=backend)
        attn = dict(knobs, scale=self.head_dim ** -0.5, sliding_window=self.sliding_window,
                    logits_soft_cap=self.logits_soft_cap)
        if self.attention_chunk is not None:
            attn["attention_chunk"] = self.attention_chunk
        sink = [s((hq,), jnp.float32)] if self.sinks else []
        if self.kernel == "paged_attention":
            fn = _with_scales(_with_sinks(functools.partial(paged_attention, **attn), self.sinks), quantized)
            args = [s((self.num_seqs, hq, self.head_dim), q_dtype), *layer, tables, lens, *sink]
            return fn, args, ()
        if self.kernel == "ragged_paged_attention":
            fn = _with_scales(_with_sinks(functools.partial(ragged_paged_attention, **attn), self.sinks), quantized)
            args = [s((self.num_tokens, hq, self.head_dim), q_dtype), *layer, tables, lens,
                    s((self.num_seqs + 1,), i32), s((1,), i32), *sink]
            return fn, args, ()
        pools = tuple(range(len(layer)))
        if self.kernel == "write_kv":
            new = s((self.num_tokens, self.num_kv_heads, self.head_dim), q_dtype)
            fn = _cache_op(functools.partial(write_kv, **knobs), quantized)
            return fn, [*layer, new, new, s((self.num_tokens,), i32)], pools
        if self.kernel == "copy_blocks":
            fn = _cache_op(functools.partial(copy_blocks, **knobs), quantized)
            return fn, [*layer, s((16,), i32), s((16,), i32)], pools
        raise ValueError(f"unknown kernel {self.kernel!r}")


def _with_sinks(fn, sinks: bool):
    """``fn(..., sinks_array)`` with the last argument as ``sinks=``."""
    if not sinks:
        return fn

    def call(*args, **kwargs):
        *rest, sinks_array = args
        return fn(*rest, sinks=sinks_array, **kwargs)

    return call


def _with_scales(fn, quantized):
    """``fn(q, k_pages, v_pages, [kv_scales,] rest...)`` with the scale words as ``kv_scales=``."""
    if not quantized:
        return fn

    def call(*args):
        q, k, v, words, *rest = args
        return fn(q, k, v, *rest, kv_scales=words)

    return call


def _cache_op(fn, quantized):
    """``fn(k_pages, v_pages, [kv_scales,] rest...)`` with the pool arrays leading."""
    def call(*args):
        if quantized:
            k, v, words, *rest = args
            return fn(k, v, *rest, kv_scales=words)
        return fn(*args)
    return call


def full(dtypes) -> list[KernelCase]:
    """Every kernel x dtype x head_dim x block_size (x group for attention), plus each attention
    knob set at head_dim 128 and group 4."""
    cases = []
    for kernel, dtype, d, bs in itertools.product(KERNELS, dtypes, HEAD_DIMS, BLOCK_SIZES):
        groups = GROUPS if kernel in ATTENTION else (1,)
        cases += [KernelCase(kernel, dtype, d, bs, g) for g in groups]
    for kernel, dtype, bs, (w, cap) in itertools.product(ATTENTION, dtypes, BLOCK_SIZES, KNOBS[1:]):
        cases.append(KernelCase(kernel, dtype, 128, bs, 4, w, cap))
    return cases + _sink_cases(dtypes) + _chunk_cases(dtypes)


def _sink_cases(dtypes) -> list[KernelCase]:
    return [KernelCase(kernel, dtype, d, bs, g, w, sinks=True)
            for kernel, dtype, (d, bs, g, w) in itertools.product(ATTENTION, dtypes, SINK_SHAPES)]


def _chunk_cases(dtypes) -> list[KernelCase]:
    return [KernelCase(kernel, dtype, d, bs, g, attention_chunk=c)
            for kernel, dtype, (d, bs, g, c) in itertools.product(ATTENTION, dtypes, CHUNK_SHAPES)]


def cross_section(dtypes) -> list[KernelCase]:
    """A cross-section of `full`: every kernel in every dtype, with every head_dim, block_size
    and group (and knob set) appearing for each kernel and dtype, in a few compilations each."""
    cases = []
    shapes = [(128, 16, 4), (64, 32, 8), (256, 64, 1), (128, 128, 2)]
    for kernel, dtype in itertools.product(KERNELS, dtypes):
        for i, (d, bs, g) in enumerate(shapes):
            w, cap = KNOBS[i % len(KNOBS)] if kernel in ATTENTION else (None, None)
            cases.append(KernelCase(kernel, dtype, d, bs, g if kernel in ATTENTION else 1, w, cap))
    return cases + _sink_cases(dtypes) + _chunk_cases(dtypes)


PRESETS = {"cross_section": cross_section, "full": full}


def cases_for(preset: str, dtypes) -> list[KernelCase]:
    """The cases of ``preset`` (a name of `PRESETS`) for page dtypes ``dtypes``."""
    names = [jnp.dtype(d).name for d in dtypes]
    return PRESETS[preset](names)
