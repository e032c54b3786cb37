"""Compile targets for deviceless ahead-of-time compiles: one chip each, TPU or NVIDIA GPU.

A TPU target is one device of a small libtpu topology (a single chip is one device of ``2x2``: the
``1x1`` names are refused). A GPU target is a ``stream_executor.GpuTargetConfigProto`` kept as text
in ``targets/<name>.txtpb`` (none ships in the jax wheels). Building a target needs the matching
compiler plugin (libtpu, or jax-cuda12-plugin with ``JAX_PLATFORMS=cpu``); see ``venv.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from importlib import resources

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target.

    Attributes:
      name: short name (``"v5e"``, ``"h100"``).
      platform: ``"tpu"`` or ``"cuda"``.
      topology: the libtpu topology a TPU chip is taken from; None for a GPU.
      fp8: whether the chip computes with float8_e4m3fn (8-bit KV pages of that dtype).
      hbm_bytes_per_s: the memory bandwidth per chip, bytes/s, from the vendor's specification.
      peak_flops: the dense bfloat16 matrix peak per chip, FLOP/s, from the same (NVIDIA's
        sheets list twice this "with sparsity").
      spec_url: where those two figures are published.
    """

    name: str
    platform: str
    topology: str | None = None
    fp8: bool = False
    hbm_bytes_per_s: float = 0.0
    peak_flops: float = 0.0
    spec_url: str = ""

    @property
    def kv_dtypes(self) -> tuple:
        """Page dtypes worth compiling for: float32, bfloat16, int8, and float8_e4m3fn where the chip has it."""
        base = (jnp.float32, jnp.bfloat16, jnp.int8)
        return base + ((jnp.float8_e4m3fn,) if self.fp8 else ())


GB, TFLOP = 1e9, 1e12
TARGETS = {t.name: t for t in (
    Target("v4", "tpu", "v4:2x2x1", hbm_bytes_per_s=1200 * GB, peak_flops=275 * TFLOP,
           spec_url="https://cloud.google.com/tpu/docs/v4"),
    Target("v5e", "tpu", "v5e:2x2", hbm_bytes_per_s=819 * GB, peak_flops=197 * TFLOP,
           spec_url="https://cloud.google.com/tpu/docs/v5e"),
    Target("v5p", "tpu", "v5p:2x2x1", hbm_bytes_per_s=2765 * GB, peak_flops=459 * TFLOP,
           spec_url="https://cloud.google.com/tpu/docs/v5p"),
    Target("v6e", "tpu", "v6e:2x2", hbm_bytes_per_s=1638 * GB, peak_flops=918 * TFLOP,
           spec_url="https://cloud.google.com/tpu/docs/v6e"),
    Target("a100", "cuda", hbm_bytes_per_s=2039 * GB, peak_flops=312 * TFLOP,
           spec_url="https://www.nvidia.com/en-us/data-center/a100/"),  # A100 80GB SXM
    Target("h100", "cuda", fp8=True, hbm_bytes_per_s=3350 * GB, peak_flops=989 * TFLOP,
           spec_url="https://www.nvidia.com/en-us/data-center/h100/"),  # H100 SXM
    Target("h200", "cuda", fp8=True, hbm_bytes_per_s=4800 * GB, peak_flops=989 * TFLOP,
           spec_url="https://www.nvidia.com/en-us/data-center/h200/"),  # H200 SXM
)}


def get(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown compile target {name!r}; known: {sorted(TARGETS)}")
    return TARGETS[name]


def gpu_target_config(name: str) -> str:
    """The ``GpuTargetConfigProto`` text of GPU target ``name``."""
    return resources.files("pallas_kernels.aot").joinpath("targets", f"{name}.txtpb").read_text()


@functools.cache
def device(name: str):
    """One abstract device of target ``name`` (the plugin of its platform must be installed)."""
    from jax.experimental import topologies

    target = get(name)
    if target.platform == "tpu":
        topo = topologies.get_topology_desc(topology_name=target.topology, platform="tpu")
    else:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=gpu_target_config(name))
    return topo.devices[0]
