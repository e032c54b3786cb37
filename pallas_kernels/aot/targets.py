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
    """

    name: str
    platform: str
    topology: str | None = None
    fp8: bool = False

    @property
    def kv_dtypes(self) -> tuple:
        """Page dtypes worth compiling for: float32, bfloat16, int8, and float8_e4m3fn where the chip has it."""
        base = (jnp.float32, jnp.bfloat16, jnp.int8)
        return base + ((jnp.float8_e4m3fn,) if self.fp8 else ())


TARGETS = {t.name: t for t in (
    Target("v4", "tpu", "v4:2x2x1"),
    Target("v5e", "tpu", "v5e:2x2"),
    Target("v5p", "tpu", "v5p:2x2x1"),
    Target("v6e", "tpu", "v6e:2x2"),
    Target("a100", "cuda"),
    Target("h100", "cuda", fp8=True),
    Target("h200", "cuda", fp8=True),
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
