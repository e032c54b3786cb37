"""Where a C++ kernel runs: the one place that decides, for every call site.

A C++ kernel can serve a call when the library is built (`library.available`), the computation is
for the CPU, every array is float32 (attention: pages without 8-bit scales), and the arrays are
not split across devices by XLA's automatic partitioning (a custom call cannot be partitioned;
inside ``shard_map``, where each device holds its own slice, it runs). The matmul takes at most
`MATMUL_ROWS` rows. Where it can, it serves if it was measured faster than the XLA path it replaces
for the call's shape class on this machine (`measure`), or wherever ``JPAGED_CPU_KERNELS=1``.
The LoRA kernel is not measured: it serves wherever it can, since it does a ``1 / slots`` share of
the work of the XLA form it replaces (every token through every slot's factors, docs/lora.md).
"""
import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from pallas_kernels.cpu import library, measure
from pallas_kernels.platform import target_platform

KERNELS = ("paged_attention", "matmul", "matmul_packed", "matmul_t", "matmul_t_packed", "greedy", "lora")
MATMUL_ROWS = measure.MATMUL_ROWS[-1]  # the C++ matmul serves x [M, K] @ w [K, N] with M up to this
LORA_MAX_RANK = 512  # the C++ LoRA kernel serves slot stacks of rank up to this (lora.cc: kMaxRank)


def _auto_sharded() -> bool:
    """Whether the computation being traced is split over devices by XLA (an Auto or Explicit mesh
    axis larger than one; ``shard_map``'s Manual axes do not count)."""
    mesh = jax.sharding.get_abstract_mesh()
    return any(size > 1 and kind != AxisType.Manual
               for size, kind in zip(mesh.axis_sizes, mesh.axis_types))


def runs(kernel: str, *arrays, kv_scales=None) -> bool:
    """Whether the C++ ``kernel`` (one of `KERNELS`) serves a call on ``arrays``: for
    ``"paged_attention"`` the query and the pages (``kv_scales``: the 8-bit pages' scale words, or None),
    for ``"matmul"`` ``x [M, K]`` and the weights ``[K, N]`` (``"matmul_packed"``: the same, the
    kernel reading their packed copies), for ``"matmul_t"`` ``x [M, K]`` and one
    weight stored transposed ``[N, K]`` (``"matmul_t_packed"``: the kernel reading a packed copy of
    its transpose), for ``"greedy"`` the logits, for ``"lora"`` ``x [T, K]`` and
    the slot stacks ``a [G, K, R]``, ``b [G, R, N]`` of each projection."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
    if not (arrays and kv_scales is None and all(x.dtype == jnp.float32 for x in arrays)):
        return False
    if kernel.startswith("matmul"):
        x, *weights = arrays
        transposed = kernel.startswith("matmul_t")
        contracted = 1 if transposed else 0
        if not (x.ndim == 2 and x.shape[0] <= MATMUL_ROWS and (not transposed or len(weights) == 1)
                and all(w.ndim == 2 and w.shape[contracted] == x.shape[1] for w in weights)):
            return False
    if kernel == "lora":
        x, *factors = arrays
        if not (x.ndim == 2 and factors and all(f.ndim == 3 for f in factors)
                and all(a.shape[2] <= LORA_MAX_RANK for a in factors[::2])):
            return False
    if _auto_sharded() or target_platform() != "cpu" or not library.available():
        return False
    if library.forced() or kernel == "lora":
        return True
    if kernel in ("matmul", "matmul_packed"):
        return measure.matmul(x.shape[1], tuple(w.shape[1] for w in weights), x.shape[0],
                              packed=kernel == "matmul_packed")
    if kernel in ("matmul_t", "matmul_t_packed"):
        return measure.matmul_t(x.shape[1], weights[0].shape[0], x.shape[0], packed=kernel == "matmul_t_packed")
    if kernel == "greedy":
        logits = arrays[0]
        return logits.ndim == 2 and measure.greedy(logits.shape[1], logits.shape[0])
    q, pages = arrays[0], arrays[1]
    return measure.paged_attention(q.shape[1], pages.shape[0], pages.shape[3], pages.shape[2])
