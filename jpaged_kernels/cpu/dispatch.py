"""Where a C++ kernel runs: the one place that decides, for every call site.

A C++ kernel serves a call when the library is built (`library.available`), the computation is
for the CPU, every array is float32 (attention: pages without 8-bit scales), and the arrays are
not split across devices by XLA's automatic partitioning (a custom call cannot be partitioned;
inside ``shard_map``, where each device holds its own slice, it runs). The matmul takes at most
`MATMUL_ROWS` rows: above them XLA's GEMM is as fast.
"""
import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from jpaged_kernels.cpu import library

KERNELS = ("paged_attention", "matmul", "greedy")
MATMUL_ROWS = 64  # the C++ matmul serves x [M, K] @ w [K, N] with M up to this


def _auto_sharded() -> bool:
    """Whether the computation being traced is split over devices by XLA (an Auto or Explicit mesh
    axis larger than one; ``shard_map``'s Manual axes do not count)."""
    mesh = jax.sharding.get_abstract_mesh()
    return any(size > 1 and kind != AxisType.Manual
               for size, kind in zip(mesh.axis_sizes, mesh.axis_types))


def _target_platform() -> str:
    """The platform being computed for: the default device's (``jax.default_device(...)``, e.g. a TPU
    or GPU compiled for ahead of time from a CPU host), else the default backend."""
    device = jax.config.jax_default_device
    return device.platform if device is not None and not isinstance(device, str) else jax.default_backend()


def runs(kernel: str, *arrays, k_scales=None) -> bool:
    """Whether the C++ ``kernel`` (one of `KERNELS`) serves a call on ``arrays``: for
    ``"paged_attention"`` the query and the pages (``k_scales``: the 8-bit pages' scales, or None),
    for ``"matmul"`` ``x [M, K]`` and the weights ``[K, N]``, for ``"greedy"`` the logits."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
    if not (arrays and k_scales is None and all(x.dtype == jnp.float32 for x in arrays)):
        return False
    if kernel == "matmul":
        x, *weights = arrays
        if not (x.ndim == 2 and x.shape[0] <= MATMUL_ROWS
                and all(w.ndim == 2 and w.shape[0] == x.shape[1] for w in weights)):
            return False
    return not _auto_sharded() and _target_platform() == "cpu" and library.available()
