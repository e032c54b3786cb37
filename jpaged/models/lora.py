"""LoRA deltas inside the model: adapters stacked in fixed device slots, applied per token.

A targeted projection ``y = x @ W`` of a model served with LoRA also computes
``x @ A[slot] @ B[slot]`` for each token, with the slot of the token's adapter (`LoRAInputs`, step
input data, so switching adapters never recompiles). ``A`` is ``[num_slots, in, max_rank]`` and
``B`` ``[num_slots, max_rank, out]``: an adapter of a smaller rank is zero-padded, its scale
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) is folded into ``B``, and slot 0 stays zero: the
base model (and padding tokens). No weight is ever merged, so one step mixes adapters freely.

Two forms of the delta, chosen per backend when the stacks are attached (``delta``):

- ``"ragged"`` (TPU, GPU): a segmented (SGMV-style) matmul: the tokens sorted by slot (the order
  computed on the host), two `jax.lax.ragged_dot` grouped matmuls over the slots' contiguous token
  groups, and the inverse permutation (`ragged_delta`); the accelerators' grouped-matmul kernels
  read each slot's factors once.
- ``"dense"`` (CPU): where the C++ kernel serves (float32, unsharded: `pallas_kernels.cpu.lora`),
  the tokens grouped by slot, each group through its own slot's factors only, the projections of
  one input in one call. Elsewhere every token through every slot's A at once
  (``[T, slots * rank]``, one GEMM), the columns of the other slots zeroed by the token's one-hot
  slot mask, then one GEMM with all slots' B (`dense_delta`); steps of at most `GATHER_MAX_TOKENS`
  tokens gather each token's factors instead (`gather_delta`). XLA's CPU lowering of ``ragged_dot``
  is slower than both at every decode and prefill shape measured (docs/lora.md).

`gather_delta` (BGMV-style: each token's A and B slices gathered) reads ``tokens x in x rank``
gathered weights: cheaper than both at a few tokens, far slower at more (docs/lora.md).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import cpu

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES


@functools.partial(jax.tree_util.register_dataclass, data_fields=["slots", "order", "inverse", "group_sizes"],
                   meta_fields=[])
@dataclasses.dataclass
class LoRAInputs:
    """Per-step adapter data (int32; T = padded tokens, G = slots incl. slot 0).

    slots[T]: each token's adapter slot (0: none). order[T]: the tokens sorted by slot (stable);
    inverse[T]: its inverse permutation. group_sizes[G]: tokens per slot, summing to T."""

    slots: jax.Array
    order: jax.Array
    inverse: jax.Array
    group_sizes: jax.Array


class LoRAWeight(nnx.Variable):
    """A stacked LoRA factor (``[slots, in, rank]`` or ``[slots, rank, out]``): not a trained
    parameter, written slot by slot when an adapter is loaded."""


class LoRAProjection(nnx.Module):
    """The A/B slot stacks of one projection ``in -> out``."""

    def __init__(self, din: int, dout: int, num_slots: int, max_rank: int, dtype, delta: str = "ragged"):
        self.a = LoRAWeight(jnp.zeros((num_slots, din, max_rank), dtype))
        self.b = LoRAWeight(jnp.zeros((num_slots, max_rank, dout), dtype))
        self.delta = delta  # static: "ragged" or "dense"

    def __call__(self, x, inputs: LoRAInputs):
        return lora_delta(x, self.a[...], self.b[...], inputs, self.delta)


class LoRAStack(nnx.Module):
    """The LoRA projections of one attention block or MLP, by projection name."""

    def __init__(self, shapes: dict[str, tuple[int, int]], num_slots: int, max_rank: int, dtype,
                 delta: str = "ragged"):
        self.projections = nnx.Dict({name: LoRAProjection(din, dout, num_slots, max_rank, dtype, delta)
                                     for name, (din, dout) in shapes.items()})

    def add(self, names: tuple[str, ...], x, ys: tuple, inputs: LoRAInputs | None) -> tuple:
        """``ys`` (the outputs of projections ``names`` of one input ``x``) plus their deltas; an
        output of a projection without a stack as it is. Where the C++ CPU kernel serves (the
        ``"dense"`` form, float32, unsharded), one call computes the deltas of all of them."""
        served = [n for n in names if inputs is not None and n in self.projections]
        if not served:
            return tuple(ys)
        first = self.projections[served[0]]
        factors = [(self.projections[n].a[...], self.projections[n].b[...]) for n in served]
        if first.delta == "dense" and cpu.runs("lora", x, *(f for pair in factors for f in pair)):
            deltas = dict(zip(served, cpu.lora(x, inputs.slots, factors)))
        else:
            deltas = {n: self.projections[n](x, inputs) for n in served}
        return tuple(y + deltas[n].astype(y.dtype) if n in deltas else y for n, y in zip(names, ys))


DELTA_FORMS = ("ragged", "dense")
GATHER_MAX_TOKENS = 8  # the "dense" form gathers each token's factors in steps of at most this many tokens


def delta_form_for(platform: str) -> str:
    """The delta form a backend runs (module docstring): ``"dense"`` on the CPU, else ``"ragged"``."""
    return "dense" if platform == "cpu" else "ragged"


def lora_delta(x, a, b, inputs: LoRAInputs, delta: str = "ragged"):
    """``x[t] @ a[slot[t]] @ b[slot[t]]`` for each token t: x [T, in], a [G, in, r], b [G, r, out]
    -> [T, out] float32; ``delta``: the form (`DELTA_FORMS`)."""
    if delta == "dense":  # the token count is static: each step shape compiles one form
        if x.shape[0] <= GATHER_MAX_TOKENS:
            return gather_delta(x, a, b, inputs.slots)
        return dense_delta(x, a, b, inputs.slots)
    return ragged_delta(x, a, b, inputs)


def dense_delta(x, a, b, slots):
    """Every token through all slots' A (x [T, in] -> [T, G, r]), the other slots' columns masked
    by the token's one-hot slot (slots [T]), then contracted with all slots' B over (G, r)."""
    h = jnp.einsum("ti,gir->tgr", x, a, preferred_element_type=jnp.float32)
    mask = slots[:, None] == jnp.arange(a.shape[0], dtype=slots.dtype)[None, :]
    h = jnp.where(mask[:, :, None], h, 0.0).astype(x.dtype)
    return jnp.einsum("tgr,gro->to", h, b, preferred_element_type=jnp.float32)


def gather_delta(x, a, b, slots):
    """BGMV: each token's A and B slices gathered, then batched vector-matrix products."""
    h = jnp.einsum("ti,tir->tr", x, a[slots], preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum("tr,tro->to", h, b[slots], preferred_element_type=jnp.float32)


def ragged_delta(x, a, b, inputs: LoRAInputs):
    """SGMV: tokens sorted by slot, two grouped matmuls over the slots' token groups, unsorted."""
    xs = x[inputs.order]
    h = jax.lax.ragged_dot(xs, a, inputs.group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    y = jax.lax.ragged_dot(h, b, inputs.group_sizes, preferred_element_type=jnp.float32)
    return y[inputs.inverse]


def lora_targets(model) -> list[tuple[int, nnx.Module, dict[str, nnx.Module]]]:
    """(layer index, module that takes a `LoRAStack`, {projection name: its `nnx.Linear`}) of
    every attention block and dense MLP of a Llama-family model (`LlamaDecoderLayer`s: Llama,
    Mistral, Qwen2/3; the attention of Mixtral and Qwen3-MoE, whose expert MLPs take none)."""
    from jpaged.models.llama import LlamaDecoderLayer

    out = []
    for i, layer in enumerate(getattr(model, "layers", [])):
        if not isinstance(layer, LlamaDecoderLayer):
            continue
        for part_name, names in (("self_attn", ATTENTION_MODULES), ("mlp", MLP_MODULES)):
            part = getattr(layer, part_name, None)
            if part is None or not hasattr(part, "lora"):
                continue
            linears = {n: getattr(part, n) for n in names if isinstance(getattr(part, n, None), nnx.Linear)}
            if linears:
                out.append((i, part, linears))
    return out


def attach_lora(model, num_slots: int, max_rank: int, dtype, abstract: bool = False, delta: str = "ragged"
                ) -> dict[tuple[int, str], tuple[int, int]]:
    """Gives every LoRA-capable block of ``model`` its zero slot stacks (``abstract``: shapes
    only, for a model made by `nnx.eval_shape`), computing deltas in form ``delta``
    (`DELTA_FORMS`); returns the (in, out) shape of each (layer, projection) that can take an adapter."""
    if delta not in DELTA_FORMS:
        raise ValueError(f"delta={delta!r}: must be one of {', '.join(DELTA_FORMS)}")
    shapes = {}
    for i, part, linears in lora_targets(model):
        dims = {n: tuple(lin.kernel.shape) for n, lin in linears.items()}
        make = lambda: LoRAStack(dims, num_slots, max_rank, dtype, delta)  # noqa: E731
        part.lora = nnx.data(nnx.eval_shape(make) if abstract else make())
        shapes.update({(i, n): d for n, d in dims.items()})
    if not shapes:
        raise ValueError(f"enable_lora: {type(model).__name__} has no projections LoRA can target "
                         f"({', '.join(TARGET_MODULES)})")
    return shapes
