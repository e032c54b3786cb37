"""Packed copies of a model's projection weights for the C++ CPU matmul.

A decode step on the CPU reads every weight once, from memory. `pallas_kernels.cpu.matmuls_packed`
reads a weight packed panel by panel (``[N / 64, K, 64]``, each panel's rows one after another),
which streams from memory faster than the same bytes spread across every row of ``[K, N]``
(docs/cpu.md). The packed copy sits beside the layer's kernel as a `PackedKernel` variable: the
kernel stays the parameter (loading, LoRA, updates, XLA's own dots all use it), and the copy is
made again from it whenever the kernel changes (`refresh`). It costs the projections' memory once
more, so the engine makes it only where the C++ matmul serves (`EngineConfig.cpu_packed_weights`).
"""
from flax import nnx

from jpaged.models.layers import PackedKernel
from jpaged.models.llama import LlamaAttention, LlamaMLP
from pallas_kernels import cpu

# the modules whose projections go through `jpaged.models.layers.project`, and those projections
PROJECTIONS = {LlamaAttention: ("q_proj", "k_proj", "v_proj", "o_proj"), LlamaMLP: ("gate_proj", "up_proj", "down_proj")}
PACKED = "packed_kernel"


def attach(model: nnx.Module) -> int:
    """Gives every float32 projection of `PROJECTIONS` whose width is a multiple of
    ``cpu.PACKED_PANEL`` its packed copy; returns the bytes they take."""
    size = 0
    for _, node in nnx.iter_graph(model):
        names = next((names for kind, names in PROJECTIONS.items() if isinstance(node, kind)), ())
        for name in names:
            layer = getattr(node, name, None)
            if type(layer) is not nnx.Linear:  # quantized: its own kernel
                continue
            kernel = layer.kernel[...]
            if kernel.dtype.name == "float32" and kernel.ndim == 2 and kernel.shape[1] % cpu.PACKED_PANEL == 0:
                setattr(layer, PACKED, PackedKernel(cpu.pack_weight(kernel)))
                size += kernel.nbytes
    return size


def is_packed(path: tuple) -> bool:
    """Whether a state path names a packed copy."""
    return bool(path) and path[-1] == PACKED


def refresh(leaves: dict, paths, changed=None) -> dict:
    """``leaves`` ({path: array} of a state's leaves, the packed copies among ``paths`` perhaps
    missing) with every packed copy made again from its kernel that is missing or whose kernel's
    path is in ``changed`` (None: every one)."""
    out = dict(leaves)
    for path in filter(is_packed, paths):
        kernel = path[:-1] + ("kernel",)
        if changed is None or kernel in changed or path not in leaves:
            out[path] = cpu.pack_weight(leaves[kernel])
    return out
