"""gpt-oss (``GptOssForCausalLM``): the Llama decoder with attention sinks, alternating sliding and
full layers, and a mixture of experts with biases and a clamped SwiGLU.

- Attention: q/k/v/o with biases; each query head has a learned sink, a logit in the softmax's
  denominator with no value (`PagedAttention`'s ``sinks``, on every kernel); ``layer_types``
  alternate 128-token sliding-window and full layers (two KV-cache groups); YaRN rope scaling
  (cos/sin scaled by its attention factor).
- MLP: a router with a bias picks each token's top ``num_experts_per_tok`` (4) of
  ``num_local_experts`` experts by logit and weights them by the softmax over those k logits;
  expert ``e`` computes ``down(swiglu(gate(x), up(x))) + down_bias`` with biases on gate and up,
  ``swiglu(g, u) = (clip(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')``, ``g' = min(g, limit)``.
- Weights: the checkpoint's fused ``gate_up_proj [E, hidden, 2 * intermediate]`` (gate and up
  interleaved column by column) is split into ``gate_proj`` and ``up_proj`` at load. MXFP4 expert
  weights (``*_blocks`` / ``*_scales``, the released checkpoints) are dequantized at load
  (`jpaged.loading.mxfp4`): the experts are then held in the engine's dtype.
"""
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jpaged import sharding
from jpaged.models.layers import rope_cos_sin, yarn_rope
from jpaged.models.llama import LlamaForCausalLM
from jpaged.models.mixtral import experts_per_token, num_experts
from jpaged.models.model_config import ModelConfig
from jpaged.models.moe import grouped_matmul, routed_experts

EXPERTS = ".mlp.experts."


def clamped_swiglu(gate, up, alpha: float, limit: float):
    """gpt-oss's expert activation (module docstring), in float32."""
    gate = jnp.minimum(gate.astype(jnp.float32), limit)
    up = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class BiasedExperts(nnx.Module):
    """``num_experts`` clamped-SwiGLU MLPs with biases, stacked: ``gate_proj``, ``up_proj`` ``[E,
    hidden, intermediate]``, ``down_proj`` ``[E, intermediate, hidden]``; ``gate_bias``,
    ``up_bias`` ``[E, intermediate]``, ``down_bias`` ``[E, hidden]``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.gate_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, intermediate, hidden), dtype))
        self.gate_bias = nnx.Param(jnp.zeros((num_experts, intermediate), dtype))
        self.up_bias = nnx.Param(jnp.zeros((num_experts, intermediate), dtype))
        self.down_bias = nnx.Param(jnp.zeros((num_experts, hidden), dtype))


class GptOssMoE(nnx.Module):
    """The router (``router [hidden, E]``, ``router_bias [E]``) and `BiasedExperts`."""

    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs, expert_parallel: bool = False):
        text = c.hf.get("text_config") or c.hf
        e, k = num_experts(c), experts_per_token(c)
        if not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok={k}: must be in [1, {e}] (the experts)")
        self.router = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (c.hidden_size, e), dtype))
        self.router_bias = nnx.Param(jnp.zeros((e,), dtype))
        self.experts = BiasedExperts(e, c.hidden_size, c.intermediate_size, dtype, rngs)
        self.top_k, self.expert_parallel = k, expert_parallel
        self.alpha, self.limit = float(text.get("swiglu_alpha", 1.702)), float(text.get("swiglu_limit", 7.0))

    def route(self, x):
        """(expert ids [T, k], weights [T, k] float32): top-k by logit, softmax over those k."""
        logits = (jnp.dot(x, self.router[...]) + self.router_bias[...]).astype(jnp.float32)
        top, expert_ids = lax.top_k(logits, self.top_k)
        return expert_ids, jax.nn.softmax(top, axis=-1)

    def __call__(self, x):
        expert_ids, weights = self.route(x)
        e = self.experts
        params = (e.gate_proj[...], e.up_proj[...], e.down_proj[...], e.gate_bias[...], e.up_bias[...],
                  e.down_bias[...])
        n = sharding.model_axis_size()
        if n == 1:
            return self._experts(x, expert_ids, weights, *params)
        num, _, intermediate = e.gate_proj.shape
        gate_spec, up_spec, down_spec = sharding.expert_specs(num, intermediate, n, self.expert_parallel)
        split_experts = self.expert_parallel and gate_spec != sharding.REPLICATED
        # biases go with their weights: gate/up's like the intermediate axis (or the experts), down's
        # whole (added on one device when the intermediate axis is split)
        bias_spec = jax.sharding.PartitionSpec(*(gate_spec[:1] + gate_spec[2:])) if gate_spec else gate_spec
        down_bias_spec = bias_spec if split_experts else sharding.REPLICATED
        sharded = (gate_spec, up_spec, down_spec) != (sharding.REPLICATED,) * 3

        def part(x, expert_ids, weights, gate, up, down, gate_bias, up_bias, down_bias):
            first = lax.axis_index(sharding.MODEL_AXIS) * gate.shape[0] if split_experts else 0
            if sharded and not split_experts:  # the intermediate axis split: one device adds down's bias
                down_bias = jnp.where(lax.axis_index(sharding.MODEL_AXIS) == 0, down_bias, 0)
            out = self._experts(x, expert_ids, weights, gate, up, down, gate_bias, up_bias, down_bias, first)
            return lax.psum(out, sharding.MODEL_AXIS) if sharded else out

        rep = sharding.REPLICATED
        specs = (rep, rep, rep, gate_spec, up_spec, down_spec, bias_spec, bias_spec, down_bias_spec)
        return jax.shard_map(part, in_specs=specs, out_specs=rep, check_vma=False)(x, expert_ids, weights, *params)

    def _experts(self, x, expert_ids, weights, gate, up, down, gate_bias, up_bias, down_bias, first_expert=0):
        def mlp(rows, row_experts, group_sizes):
            g = grouped_matmul(rows, gate, group_sizes) + gate_bias[row_experts]
            u = grouped_matmul(rows, up, group_sizes) + up_bias[row_experts]
            h = clamped_swiglu(g, u, self.alpha, self.limit).astype(rows.dtype)
            return grouped_matmul(h, down, group_sizes) + down_bias[row_experts]

        return routed_experts(x, expert_ids, weights, gate, up, down, act=None, first_expert=first_expert,
                              expert_mlp=mlp)


class GptOssForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` with attention sinks, YaRN rope and `GptOssMoE` MLPs; ``expert_parallel``:
    whole experts per device."""

    HAS_EXPERTS = True

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs, expert_parallel: bool = False):
        self.expert_parallel = expert_parallel
        super().__init__(config, dtype=dtype, attention_backend=attention_backend, rngs=rngs)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        text = config.hf.get("text_config") or config.hf
        quant = text.get("quantization_config") or config.hf.get("quantization_config")
        if quant is not None and quant.get("quant_method") != "mxfp4":
            raise ValueError(f"quantization_config.quant_method={quant.get('quant_method')!r}: not supported "
                             "for GptOssForCausalLM (mxfp4 is, dequantized at load)")
        if not config.attention_bias:
            raise ValueError("attention_bias=False: GptOssForCausalLM's attention has biases")
        kind = (config.rope_scaling or {}).get("rope_type", (config.rope_scaling or {}).get("type"))
        if kind not in (None, "yarn"):
            raise ValueError(f"rope_parameters.rope_type={kind!r}: GptOssForCausalLM supports default and yarn")
        num_experts(config)

    def _yarn(self) -> bool:
        return self.config.rope_scaling is not None

    def rope_inv_freq(self):
        return yarn_rope(self.config)[0] if self._yarn() else super().rope_inv_freq()

    def embed_inputs(self, input_ids, positions):
        cos, sin = rope_cos_sin(self.inv_freq[...], positions)
        if self._yarn():
            factor = yarn_rope(self.config)[1]
            cos, sin = cos * factor, sin * factor
        return self.embed_tokens(input_ids), (cos, sin)

    def make_mlp(self, c: ModelConfig, layer: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
        return GptOssMoE(c, dtype, rngs, self.expert_parallel)

    def mlp_weight_map(self, layer: int, path: tuple, prefix: str):
        moe, p = path + ("mlp",), prefix + "mlp."
        out = [(moe + ("router",), p + "router.weight", True), (moe + ("router_bias",), p + "router.bias", False)]
        # the names `convert_hf_weights` gives the parts of the fused gate_up tensors
        for ours, theirs in (("gate_proj", "gate_up_proj[gate]"), ("up_proj", "gate_up_proj[up]"),
                             ("down_proj", "down_proj"), ("gate_bias", "gate_up_proj_bias[gate]"),
                             ("up_bias", "gate_up_proj_bias[up]"), ("down_bias", "down_proj_bias")):
            out.append((moe + ("experts", ours), p + "experts." + theirs, False))
        return out

    @staticmethod
    def convert_hf_weights(weights):
        """The checkpoint's tensors as `hf_weight_map` names them: MXFP4 ``*_blocks`` with their
        ``*_scales`` dequantized (float32 ``[E, in, out]``), and each fused ``gate_up_proj`` (and
        its bias) split into its interleaved gate (even columns) and up (odd columns) halves."""
        from jpaged.loading.mxfp4 import dequantize_mxfp4

        pending = {}  # MXFP4 name -> the half (blocks or scales) that came first
        for name, array in weights:
            if EXPERTS in name and name.endswith(("_blocks", "_scales")):
                base, part = name.rsplit("_", 1)
                other = pending.pop((base, "scales" if part == "blocks" else "blocks"), None)
                if other is None:
                    pending[(base, part)] = array
                    continue
                blocks, scales = (array, other) if part == "blocks" else (other, array)
                name, array = base, dequantize_mxfp4(blocks, scales)
            if EXPERTS in name and name.rsplit(".", 1)[-1] in ("gate_up_proj", "gate_up_proj_bias"):
                yield f"{name}[gate]", array[..., 0::2]
                yield f"{name}[up]", array[..., 1::2]
            else:
                yield name, array
        if pending:
            (base, part), _ = next(iter(pending.items()))
            raise ValueError(f"checkpoint tensor {base}_{part}: MXFP4 {part} without its "
                             f"{'scales' if part == 'blocks' else 'blocks'}")
