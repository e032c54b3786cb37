"""Tensor parallelism with JAX's own machinery: a `Mesh` with a ``model`` axis, `NamedSharding`
rules for the weights and the KV pool, and `jax.shard_map` around paged attention.

Layout (Megatron-LM style, one all-reduce per attention block and per MLP block):
- q/k/v projections and MLP gate/up (fc1, c_fc) are column-parallel: kernel ``[in, out]`` split on
  ``out``, so every device holds whole heads;
- attention output and MLP down projections (o_proj, down_proj, out_proj, fc2, c_proj) are
  row-parallel: split on ``in``; XLA inserts the all-reduce after them;
- the input embedding table is split on the hidden axis and the output projection (lm_head) on the
  vocabulary axis; norms, biases of row-parallel layers and position tables are replicated;
- the KV pool ``[num_kv_heads, num_blocks, block_size, head_dim]`` is split on its head axis, so each
  device's pool holds only its heads' slice of every block; so are the scales of 8-bit pages
  (``[num_kv_heads, num_blocks, block_size]``), which thus stay with their pages. Block tables stay
  on the host, once, and reach every device replicated.
- the pool and every embedding table are also kept in row-major order (`kv_pool_format`,
  `param_format`), the order the kernels and the rows' gather read.

When a model has fewer KV heads than devices, each KV head is replicated ``N / num_kv_heads`` times
at load time (the weights of k/v projections are repeated), so every device owns one KV head: the
KV pool then costs ``N / num_kv_heads`` times the unsharded pool in total (each device holds
1 / num_kv_heads of it instead of 1 / N).

A weight whose split dimension does not divide by N is replicated (correct, more memory). GPT-2's
fused ``c_attn`` is replicated: a contiguous split would mix q, k and v.

Mixture-of-experts layers (`jpaged.models.moe`): the stacked experts (``experts.gate_proj`` /
``up_proj`` ``[E, hidden, intermediate]``, ``down_proj`` ``[E, intermediate, hidden]``) split on
the intermediate axis like a dense MLP, or, with expert parallelism, on the expert axis: each
device then holds whole experts (`expert_specs`). The router is replicated.

Quantized weights (`jpaged.models.quantized`) split the same way, their scales with them: an int8
kernel keeps the ``[in, out]`` layout, its per-output-channel ``scale [out]`` is split like a
column-parallel bias and replicated for a row-parallel layer (and for the token table, whose scale
is per vocabulary row while the table splits on hidden). GGUF blocks ``qweight [in / 32, k, out]``
with ``scales`` / ``mins`` ``[in / 32, out]`` split on ``out`` (column) or on whole blocks of
``in`` (row; the token table on its hidden blocks). A scale of any other shape has no place in
the layout: a ValueError.

LoRA slot stacks split like the layer they adapt (`_LORA_SPECS`): a column-parallel layer's B on
its output axis (A replicated), a row-parallel layer's A on its input axis (B replicated).
"""
import functools
import re

import jax
from jax.experimental.layout import Format, Layout
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MODEL_AXIS = "model"
COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_fc", "lm_head"}
ROW = {"o_proj", "down_proj", "out_proj", "fc2", "c_proj"}
EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")  # stacked experts [E, ...] of an `experts` module


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A 1-D mesh with a ``model`` axis over the first N devices (or the given ones)."""
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: only {len(devices)} devices available")
    return Mesh(np.array(devices[:tensor_parallel_size]), (MODEL_AXIS,), axis_types=(AxisType.Auto,))


# Leaf name -> (its spec in a column-parallel layer, in a row-parallel layer, in the token table).
_LEAF_SPECS = {
    "kernel": (P(None, MODEL_AXIS), P(MODEL_AXIS, None), None),
    "bias": (P(MODEL_AXIS), P(), None),
    "embedding": (None, None, P(None, MODEL_AXIS)),
    "scale": (P(MODEL_AXIS), P(), P()),                                   # int8, per output channel
    "qweight": (P(None, None, MODEL_AXIS), P(MODEL_AXIS, None, None), P(MODEL_AXIS, None, None)),  # GGUF
    "scales": (P(None, MODEL_AXIS), P(MODEL_AXIS, None), P(MODEL_AXIS, None)),
    "mins": (P(None, MODEL_AXIS), P(MODEL_AXIS, None), P(MODEL_AXIS, None)),
}
_QUANT_LEAF_NDIM = {"scale": 1, "qweight": 3, "scales": 2, "mins": 2}
# LoRA slot stacks (`jpaged.models.lora`): A [slots, in, rank], B [slots, rank, out], split like
# the layer they adapt: (column-parallel, row-parallel). A column-parallel layer's input is whole on
# every device, so A is replicated and B split on out like the kernel; a row-parallel layer's input
# is split on in, so A is split on in (its partial sums all-reduced, rank-wide) and B replicated.
_LORA_SPECS = {"a": (P(), P(None, MODEL_AXIS, None)), "b": (P(None, None, MODEL_AXIS), P())}


def expert_specs(num_experts: int, intermediate: int, tp: int, expert_parallel: bool) -> tuple[P, P, P]:
    """The specs of stacked experts (gate_proj, up_proj, down_proj): whole experts per device with
    ``expert_parallel``, else the intermediate axis split; replicated where it does not divide."""
    if expert_parallel and num_experts % tp == 0:
        return (P(MODEL_AXIS, None, None),) * 3
    if not expert_parallel and intermediate % tp == 0:
        return P(None, None, MODEL_AXIS), P(None, None, MODEL_AXIS), P(None, MODEL_AXIS, None)
    return (REPLICATED,) * 3


def param_spec(path: tuple, shape: tuple, tp: int, expert_parallel: bool = False) -> P:
    """The PartitionSpec of the parameter at attribute ``path`` (e.g. ("layers", 0, "mlp", "up_proj", "kernel"));
    ``expert_parallel``: stacked experts split on the expert axis (`expert_specs`)."""
    names = [p for p in path if isinstance(p, str)]
    layer, leaf = (names[-2] if len(names) > 1 else ""), names[-1]
    if layer == "experts" and leaf in EXPERT_LEAVES and len(shape) == 3:
        intermediate = shape[1] if leaf == "down_proj" else shape[2]
        return expert_specs(shape[0], intermediate, tp, expert_parallel)[EXPERT_LEAVES.index(leaf)]
    if "lora" in names and leaf in _LORA_SPECS and len(shape) == 3 and layer in COLUMN | ROW:
        spec = _LORA_SPECS[leaf][0 if layer in COLUMN else 1]
        return spec if all(axis is None or shape[dim] % tp == 0 for dim, axis in enumerate(spec)) else P()
    role = 0 if layer in COLUMN else 1 if layer in ROW else 2 if layer == "embed_tokens" else None
    if role is not None and leaf in _QUANT_LEAF_NDIM and len(shape) != _QUANT_LEAF_NDIM[leaf]:
        raise ValueError(f"weight {'.'.join(map(str, path))}: a quantization {leaf!r} of shape {tuple(shape)} "
                         f"cannot be split with its layer's output channels (expected {_QUANT_LEAF_NDIM[leaf]}-D)")
    spec = P()
    if role is not None and leaf in _LEAF_SPECS:
        spec = _LEAF_SPECS[leaf][role] or P()
    for dim, axis in enumerate(spec):
        if axis is not None and shape[dim] % tp:
            return P()
    return spec


def param_format(path: tuple, shape: tuple, mesh: Mesh, expert_parallel: bool = False) -> NamedSharding | Format:
    """Where the parameter at ``path`` lives: its `param_spec` on ``mesh``, and for an embedding
    table (a leaf ``embedding``, read by a gather of its rows) also row-major order. XLA:TPU's
    default order for a table whose rows would pad its tiles (gpt-oss-120b's shard is 360 wide, not
    a multiple of 128 lanes) is column-major, and a step taking it so copies the whole table into
    row-major order for the gather, every step. (On the CPU row-major is the default: nothing
    changes there.)"""
    target = NamedSharding(mesh, param_spec(path, shape, mesh.shape[MODEL_AXIS], expert_parallel))
    if is_row_major_leaf(path):
        return Format(Layout(major_to_minor=tuple(range(len(shape)))), target)
    return target


def is_row_major_leaf(path: tuple) -> bool:
    """Whether the parameter at ``path`` is kept in row-major order (`param_format`)."""
    names = [p for p in path if isinstance(p, str)]
    return bool(names) and names[-1] == "embedding"


def is_placed(x, target: NamedSharding | Format) -> bool:
    """Whether ``x`` is a device array already on ``target``'s sharding (and in its order, if a
    `Format` names one)."""
    sharding = target.sharding if isinstance(target, Format) else target
    if not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim)):
        return False
    layout = target.layout if isinstance(target, Format) else None
    return layout is None or x.format.layout.major_to_minor == layout.major_to_minor


def kv_head_replication(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """How many times each KV head is repeated so that N devices each own whole heads."""
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp}: num_attention_heads={num_heads} is not divisible by it")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp}: num_key_value_heads={num_kv_heads} is not divisible by it")
        return 1
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp}: must be a multiple of num_key_value_heads={num_kv_heads}")
    return tp // num_kv_heads


_KV_PROJ = re.compile(r"(k_proj|v_proj)\.(weight|bias)$")


def repeat_kv_heads(name: str, array: np.ndarray, num_kv_heads: int, factor: int) -> np.ndarray:
    """Repeats each KV head of a Hugging Face k/v projection (``[heads * head_dim, ...]``) ``factor`` times."""
    if factor == 1 or not _KV_PROJ.search(name):
        return array
    heads = array.reshape(num_kv_heads, -1, *array.shape[1:])
    return np.repeat(heads, factor, axis=0).reshape(-1, *array.shape[1:])


def key_path_names(key_path) -> tuple:
    """A pytree key path of an nnx.State leaf as attribute names, e.g. ("layers", 0, "mlp", "up_proj", "kernel")."""
    names = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in key_path)
    return names[:-1] if names and names[-1] in ("value", "raw_value") else names


def shard_state(state, mesh: Mesh, expert_parallel: bool = False):
    """Every leaf of a model state placed by the rules on ``mesh`` (no-op for leaves already there)."""
    local = all(d.process_index == jax.process_index() for d in mesh.devices.flat)

    def place(key_path, x):
        target = param_format(key_path_names(key_path), x.shape, mesh, expert_parallel)
        if is_placed(x, target):
            return x
        if local:  # device to device, never through the host
            return jax.device_put(x, target)
        return make_array(target, np.asarray(x))  # a mesh spanning processes

    return jax.tree_util.tree_map_with_path(place, state)


def make_array(target: NamedSharding | Format, array: np.ndarray) -> jax.Array:
    """Places a host array straight into its shards (and order, given a `Format`): each device
    receives only its slice."""
    # each shard a copy: on the CPU a shard would alias the host array, and its per-device array
    # then stays live (and counted) after the engine drops the weight (sleep, update_weights)
    return jax.make_array_from_callback(array.shape, target, lambda index: np.array(array[index]))


# shard_map spec prefixes of `shard_heads`: activations [T, heads, ...] and pool arrays [heads, blocks, ...].
HEADS = P(None, MODEL_AXIS)
POOL = P(MODEL_AXIS)
REPLICATED = P()


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_pool_sharding(mesh: Mesh, ndim: int = 4) -> NamedSharding:
    """A pool array (pages, or the scales of 8-bit pages) split on its leading head axis."""
    return NamedSharding(mesh, P(MODEL_AXIS, *[None] * (ndim - 1)))


def kv_pool_format(mesh: Mesh, ndim: int = 4) -> Format:
    """`kv_pool_sharding` with the array's dimensions in row-major order, the order the kernels
    read. XLA:TPU's default order for an array whose row-major tiles would be padded (pages of
    head_dim 64 fill 64 of a tile's 128 lanes) is another one, and a step taking the pool in that
    order copies the whole pool into row-major order and back around every kernel call. (On the
    CPU row-major is the default order: nothing changes there.)"""
    return Format(Layout(major_to_minor=tuple(range(ndim))), kv_pool_sharding(mesh, ndim))


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape: tuple, dtype, sharding: NamedSharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def zeros_sharded(shape, dtype, sharding: NamedSharding | Format) -> jax.Array:
    """A zero array created directly in its shards (no full copy on one device); one compiled
    function per (shape, dtype, sharding), so a pool made again (`KVPool.reset`) compiles nothing."""
    return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()


def state_pool_sharding(mesh: Mesh, shape: tuple, head_axis: int | None) -> NamedSharding:
    """A recurrent-state pool array ``[num_slots, *state]`` split on its state's ``head_axis`` when the
    heads divide by the ``model`` axis, else replicated (a convolution's inputs are)."""
    tp = mesh.shape[MODEL_AXIS]
    if head_axis is None or shape[1 + head_axis] % tp:
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(*[MODEL_AXIS if d == 1 + head_axis else None for d in range(len(shape))]))


def model_axis_size() -> int:
    """Size of the ``model`` axis of the mesh being traced under (1 when there is none)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[MODEL_AXIS]


def shard_heads(fn, in_specs, out_specs):
    """``fn`` under `jax.shard_map` over the ``model`` axis: each device runs it on its own heads.

    Specs are pytree prefixes: `HEADS` for [T, heads, ...] activations, `POOL` for a layer's pool
    tuple (pages and, with 8-bit pages, their scales: every array leads with the head axis),
    `REPLICATED` for the rest (metadata, block ids).
    """
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)
