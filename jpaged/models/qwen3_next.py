"""Qwen3-Next (``Qwen3NextForCausalLM``) and Qwen3.5 text (``Qwen3_5ForCausalLM``): a decoder that
mixes gated delta-net linear attention (`jpaged.models.gated_delta_net`: a recurrent state per
sequence, no KV) with full attention (paged KV), three linear layers to one full one by default.

- ``layer_types`` (or every ``full_attention_interval``-th layer full, the rest linear) decides
  each layer's kind.
- Full attention: ``q_proj`` gives each head its query and an output gate (``[q, gate]`` per
  head); per-head RMS norms of q and k; rope on the first ``partial_rotary_factor`` of each head's
  dimensions; the attention's output times ``sigmoid(gate)`` goes into ``o_proj``.
- Norms are ``x * (1 + weight)`` (zero-centred weights), as Gemma's.
- MLP (Qwen3-Next): layers outside ``mlp_only_layers`` whose index + 1 is a multiple of
  ``decoder_sparse_step`` route each token to its top ``num_experts_per_tok`` of ``num_experts``
  experts (softmax, renormalized with ``norm_topk_prob``) plus a shared SwiGLU expert of
  ``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``; the others
  (and every layer of Qwen3.5 text) have a dense SwiGLU of ``intermediate_size``.
- Weights: Qwen3-Next's fused ``in_proj_qkvz`` (per key head: q, k, its value heads' v and z) and
  ``in_proj_ba`` are split at load into Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``
  and ``in_proj_a`` (`convert_hf_weights`); the multi-token-prediction weights (``mtp.*``) are
  not used.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.attention import AttentionMetadata
from jpaged.models.gated_delta_net import GatedDeltaNet, text_config
from jpaged.models.layers import RMSNorm, apply_rope, linear, project, rope_inv_freq
from jpaged.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from jpaged.models.model_config import ModelConfig
from jpaged.models.moe import SparseMoE

LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types(c: ModelConfig) -> list[str]:
    """Each layer's kind, from ``layer_types`` or ``full_attention_interval`` (default 4)."""
    text = text_config(c)
    interval = text.get("full_attention_interval", 4)
    return list(text.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                            for i in range(c.num_layers)])


def partial_rotary_factor(c: ModelConfig) -> float:
    text = text_config(c)
    factor = text.get("partial_rotary_factor")
    if factor is None:
        factor = (text.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    return factor


def rotary_dim(c: ModelConfig) -> int:
    return int(c.head_dim * partial_rotary_factor(c))


class Qwen3NextAttention(LlamaAttention):
    """`LlamaAttention` whose ``q_proj`` also gives an output gate per head, with zero-centred q/k
    norms and partial rope (cos/sin cover the rotary dimensions only)."""

    def __init__(self, c: ModelConfig, layer: int, dtype, backend: str, rngs: nnx.Rngs):
        super().__init__(c, layer, dtype, backend, rngs, qk_norm=True, unit_offset=True)
        self.q_proj = linear(c.hidden_size, 2 * c.num_heads * c.head_dim, c.attention_bias, dtype, rngs)

    def __call__(self, x, cos, sin, kv_cache, md: AttentionMetadata):
        t = x.shape[0]
        q_gate, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q_gate = q_gate.reshape(t, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate[..., :self.head_dim], q_gate[..., self.head_dim:]
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        out, kv_cache = self.attn(q, k, v, kv_cache, md)
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return project(out.reshape(t, -1), self.o_proj)[0], kv_cache


class SharedExpertMoE(SparseMoE):
    """`SparseMoE` plus a shared SwiGLU expert on every token, scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs, expert_parallel: bool = False):
        text = text_config(c)
        super().__init__(c.hidden_size, text["moe_intermediate_size"], text["num_experts"],
                         text["num_experts_per_tok"], normalize=bool(text.get("norm_topk_prob", True)),
                         hidden_act=c.hidden_act, dtype=dtype, rngs=rngs, expert_parallel=expert_parallel)
        shared = text.get("shared_expert_intermediate_size") or 0
        self.shared_expert = LlamaMLP(c, dtype, rngs, intermediate_size=shared) if shared else None
        self.shared_expert_gate = linear(c.hidden_size, 1, False, dtype, rngs) if shared else None

    def __call__(self, x):
        out = super().__call__(x)
        if self.shared_expert is None:
            return out
        return out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nnx.Module):
    """Either a linear-attention layer (``linear_attn``; its cache is its state pool) or a full
    one (``self_attn``; its cache is its KV pool tensor), then the MLP."""

    def __init__(self, c: ModelConfig, layer: int, dtype, backend: str, rngs: nnx.Rngs, mlp: nnx.Module):
        linear_layer = layer_types(c)[layer] == "linear_attention"
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps, dtype, unit_offset=True)
        self.linear_attn = GatedDeltaNet(c, dtype, rngs) if linear_layer else None
        self.self_attn = None if linear_layer else Qwen3NextAttention(c, layer, dtype, backend, rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps, dtype, unit_offset=True)
        self.mlp = mlp

    def __call__(self, x, cos, sin, cache, md):
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            h, cache = self.linear_attn(h, cache, md)
        else:
            h, cache = self.self_attn(h, cos, sin, cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """``__call__(input_ids[T], positions[T], caches, md) -> (hidden[T, H], caches)``: ``caches``
    in the order of the KV-cache layout (`md.kv_layout`): a full layer's KV pool tensor, a linear
    layer's state pool. ``compute_logits(hidden[S, H]) -> [S, vocab]`` float32."""

    HAS_EXPERTS = True

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs, expert_parallel: bool = False):
        c = self.config = config
        self.expert_parallel = expert_parallel
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Qwen3NextDecoderLayer(c, i, dtype, attention_backend, rngs,
                                                      self.make_mlp(c, i, dtype, rngs)) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, dtype, unit_offset=True)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, rngs)
        self.inv_freq = nnx.Variable(jnp.asarray(self.rope_inv_freq()))

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """ValueError naming the config.json field this class cannot honour."""
        super().check_config(config)
        text = text_config(config)
        types = layer_types(config)
        bad = sorted(set(types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types: {bad} not supported by {config.architecture} (it runs {list(LAYER_TYPES)})")
        if len(types) != config.num_layers:
            raise ValueError(f"layer_types: {len(types)} entries for num_hidden_layers={config.num_layers}")
        if "full_attention" not in types:
            raise ValueError("layer_types: no full_attention layer (jpaged needs at least one KV-cache layer)")
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim"):
            value = text.get(name, 4 if name == "linear_conv_kernel_dim" else None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if text["linear_num_value_heads"] % text["linear_num_key_heads"]:
            raise ValueError(f"linear_num_value_heads={text['linear_num_value_heads']}: not a multiple of "
                             f"linear_num_key_heads={text['linear_num_key_heads']}")
        dim = rotary_dim(config)
        if not 0 < dim <= config.head_dim or dim % 2:
            raise ValueError(f"partial_rotary_factor={partial_rotary_factor(config)!r}: gives {dim} rotary dimensions "
                             f"of head_dim={config.head_dim} (must be even and positive)")
        if config.rope_scaling is not None:
            raise ValueError(f"rope_scaling={config.rope_scaling!r}: {config.architecture} runs the default rope only")
        if any(w is not None for w in config.sliding_windows):
            raise ValueError("layer_types: sliding_attention is not supported by " + config.architecture)
        if text.get("num_experts"):
            k, e = text.get("num_experts_per_tok"), text["num_experts"]
            if not isinstance(k, int) or not 1 <= k <= e:
                raise ValueError(f"num_experts_per_tok={k!r}: must be in [1, {e}] (num_experts)")
            if not text.get("moe_intermediate_size"):
                raise ValueError(f"moe_intermediate_size={text.get('moe_intermediate_size')!r}: the experts need it")

    def rope_inv_freq(self):
        """The inverse frequencies of the rotary dimensions (``partial_rotary_factor`` of head_dim)."""
        return rope_inv_freq(dataclasses.replace(self.config, head_dim=rotary_dim(self.config)))

    def is_sparse(self, layer: int) -> bool:
        text = text_config(self.config)
        return (bool(text.get("num_experts")) and layer not in (text.get("mlp_only_layers") or [])
                and (layer + 1) % text.get("decoder_sparse_step", 1) == 0)

    def make_mlp(self, c: ModelConfig, layer: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
        if self.is_sparse(layer):
            return SharedExpertMoE(c, dtype, rngs, self.expert_parallel)
        return LlamaMLP(c, dtype, rngs)

    def mlp_weight_map(self, layer: int, path: tuple, prefix: str):
        if not self.is_sparse(layer):
            return super().mlp_weight_map(layer, path, prefix)
        moe, p = path + ("mlp",), prefix + "mlp."
        out = [(moe + ("router",), p + "gate.weight", True)]
        for e in range(text_config(self.config)["num_experts"]):
            out += [(moe + ("experts", proj, e), f"{p}experts.{e}.{proj}.weight", True)
                    for proj in ("gate_proj", "up_proj", "down_proj")]
        if text_config(self.config).get("shared_expert_intermediate_size"):
            out += LlamaMLP.hf_weight_map(moe + ("shared_expert",), p + "shared_expert.")
            out.append((moe + ("shared_expert_gate", "kernel"), p + "shared_expert_gate.weight", True))
        return out

    def hf_weight_map(self):
        c = self.config
        out = [(("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
               (("norm", "weight"), "model.norm.weight", False)]
        if self.lm_head is not None:
            out.append((("lm_head", "kernel"), "lm_head.weight", True))
        for i, kind in enumerate(layer_types(c)):
            p, L = f"model.layers.{i}.", ("layers", i)
            out += [(L + (norm, "weight"), p + norm + ".weight", False)
                    for norm in ("input_layernorm", "post_attention_layernorm")]
            if kind == "linear_attention":
                out += GatedDeltaNet.hf_weight_map(L + ("linear_attn",), p + "linear_attn.")
            else:
                out += LlamaAttention.hf_weight_map(c, L + ("self_attn",), p + "self_attn.", True)
            out += self.mlp_weight_map(i, L, p)
        return out

    def convert_hf_weights(self, weights):
        """Qwen3-Next's fused ``in_proj_qkvz`` ``[Hk * (2 Dk + 2 (Hv / Hk) Dv), hidden]`` and
        ``in_proj_ba`` ``[Hk * 2 (Hv / Hk), hidden]`` (each key head's block: q, k, then its value
        heads' v and z; b, then a) as Qwen3.5's ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``,
        ``in_proj_b`` and ``in_proj_a``."""
        text = text_config(self.config)
        hk, hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
        dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
        r = hv // hk
        for name, array in weights:
            if name.endswith(".in_proj_qkvz.weight"):
                base = name[:-len("qkvz.weight")]
                blocks = np.asarray(array).reshape(hk, 2 * dk + 2 * r * dv, -1)
                q, k, v, z = np.split(blocks, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
                yield base + "qkv.weight", np.concatenate([part.reshape(-1, blocks.shape[-1]) for part in (q, k, v)])
                yield base + "z.weight", z.reshape(-1, blocks.shape[-1])
            elif name.endswith(".in_proj_ba.weight"):
                base = name[:-len("ba.weight")]
                blocks = np.asarray(array).reshape(hk, 2 * r, -1)
                yield base + "b.weight", blocks[:, :r].reshape(-1, blocks.shape[-1])
                yield base + "a.weight", blocks[:, r:].reshape(-1, blocks.shape[-1])
            else:
                yield name, array
