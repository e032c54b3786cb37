"""Packed copies of a model's projection weights for the C++ CPU matmul.

A decode step on the CPU reads every weight once, from memory. `pallas_kernels.cpu.matmuls_packed`
reads a weight packed panel by panel (``[N / 64, K, 64]``, each panel's rows one after another),
which streams from memory faster than the same bytes spread across every row of ``[K, N]``
(docs/cpu.md). The packed copy sits beside the layer's kernel as a `PackedKernel` variable: the
kernel stays the parameter (loading, LoRA, updates, XLA's own dots all use it), and the copy is
made again from it whenever the kernel changes (`refresh`). The output projection gets one too: an
``lm_head``'s kernel, or a tied embedding's table ``[vocab, H]`` packed as its transpose (the
logits' weight ``[H, vocab]``), beside the table. It costs those weights' memory once more, so the
engine makes it only where the C++ matmul serves (`EngineConfig.cpu_packed_weights`).
"""
from flax import nnx

from jpaged.models.layers import PackedKernel
from jpaged.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pallas_kernels import cpu

# the modules whose projections go through `jpaged.models.layers.project`, and those projections
PROJECTIONS = {LlamaAttention: ("q_proj", "k_proj", "v_proj", "o_proj"), LlamaMLP: ("gate_proj", "up_proj", "down_proj"),
               LlamaForCausalLM: ("lm_head",)}
# the models whose logits come from their embedding table when it is tied (no lm_head), and that table
TIED_EMBEDDING = {LlamaForCausalLM: "embed_tokens"}
PACKED = "packed_kernel"


def packable(weight) -> bool:
    """Whether ``weight [K, N]`` gets a packed copy: float32, N a multiple of ``cpu.PACKED_PANEL``."""
    return weight.dtype.name == "float32" and weight.ndim == 2 and weight.shape[1] % cpu.PACKED_PANEL == 0


def attach(model: nnx.Module) -> int:
    """Gives every float32 projection of `PROJECTIONS` whose width is a multiple of
    ``cpu.PACKED_PANEL``, and every tied embedding of `TIED_EMBEDDING` whose vocabulary is, its
    packed copy; returns the bytes they take."""
    size = 0
    for _, node in nnx.iter_graph(model):
        names = next((names for kind, names in PROJECTIONS.items() if isinstance(node, kind)), ())
        for name in names:
            layer = getattr(node, name, None)
            if type(layer) is nnx.Linear and packable(layer.kernel[...]):  # not quantized: its own kernel
                setattr(layer, PACKED, PackedKernel(cpu.pack_weight(layer.kernel[...])))
                size += layer.kernel[...].nbytes
        embed = next((name for kind, name in TIED_EMBEDDING.items() if isinstance(node, kind)), None)
        if embed is not None and getattr(node, "lm_head", None) is None:
            table = getattr(node, embed)
            if type(table) is nnx.Embed and packable(table.embedding[...].T):
                setattr(table, PACKED, PackedKernel(cpu.pack_weight(table.embedding[...].T)))
                size += table.embedding[...].nbytes
    return size


def is_packed(path: tuple) -> bool:
    """Whether a state path names a packed copy."""
    return bool(path) and path[-1] == PACKED


def source(path: tuple, paths) -> tuple:
    """The path of the weight a packed copy at ``path`` is made from: its layer's kernel, or its
    embedding's table (packed as its transpose)."""
    kernel = path[:-1] + ("kernel",)
    return kernel if kernel in paths else path[:-1] + ("embedding",)


def pack(path: tuple, weight):
    """The packed copy of ``weight``, the weight at ``path`` (`source`)."""
    return cpu.pack_weight(weight.T if path[-1] == "embedding" else weight)


def refresh(leaves: dict, paths, changed=None) -> dict:
    """``leaves`` ({path: array} of a state's leaves, the packed copies among ``paths`` perhaps
    missing) with every packed copy made again from its source that is missing or whose source's
    path is in ``changed`` (None: every one)."""
    out, known = dict(leaves), set(paths)
    for path in filter(is_packed, known):
        weight = source(path, known)
        if changed is None or weight in changed or path not in leaves:
            out[path] = pack(weight, leaves[weight])
    return out
