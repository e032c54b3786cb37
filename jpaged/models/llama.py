"""Llama-family decoder in Flax NNX: Llama 2/3 (GQA, Llama 3.1 rope scaling), Mistral (its sliding
window), Qwen2 (q/k/v biases), Qwen3 (an RMS norm of each head's q and k) and SmolLM2 (tied
embeddings), attending through the paged KV cache.

The template for new decoders: the mixture-of-experts models (`mixtral`, `qwen3_moe`) are this
model with another MLP (`make_mlp`, `mlp_weight_map`); Gemma reuses its attention and MLP.
"""
import jax.numpy as jnp
from flax import nnx

from jpaged.models.attention import AttentionMetadata, PagedAttention
from jpaged.models.layers import (RMSNorm, activation, apply_rope, linear, project, rope_cos_sin, rope_inv_freq,
                                  run_layers, tied_or_head_logits)
from jpaged.models.model_config import ModelConfig, require_unset

QK_NORM_MODELS = ("qwen3", "qwen3_moe")  # model types with a per-head RMS norm of q and k
SINK_MODELS = ("gpt_oss",)  # model types with an attention sink per query head


class LlamaAttention(nnx.Module):
    """q/k/v projections, rope, paged attention, output projection.

    ``qk_norm``: an RMS norm over each head's q and k before rope (Qwen3, Gemma 3), with
    ``unit_offset`` weights for Gemma. Layer ``layer``'s sliding window, the attention soft cap and
    ``query_pre_attn_scalar`` (the scale) come from the config; ``sinks`` ``[num_heads]``, the
    attention sinks of `SINK_MODELS`, are a parameter."""

    def __init__(self, c: ModelConfig, layer: int, dtype, backend: str, rngs: nnx.Rngs, *, qk_norm: bool = False,
                 unit_offset: bool = False):
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = linear(c.hidden_size, c.num_heads * c.head_dim, c.attention_bias, dtype, rngs)
        self.k_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.attention_bias, dtype, rngs)
        self.v_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.attention_bias, dtype, rngs)
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, self.output_bias(c), dtype, rngs)
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps, dtype, unit_offset) if qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps, dtype, unit_offset) if qk_norm else None
        scale = None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar ** -0.5
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.head_dim, scale=scale, backend=backend,
                                   sliding_window=c.window_of(layer), logits_soft_cap=c.attn_logit_softcap)
        self.sinks = nnx.Param(jnp.zeros((c.num_heads,), dtype)) if c.model_type in SINK_MODELS else None
        self.lora = None  # a `jpaged.models.lora.LoRAStack` when served with enable_lora

    @staticmethod
    def output_bias(c: ModelConfig) -> bool:
        """o_proj has a bias with ``attention_bias``, except in Qwen2 (biases on q, k and v only)."""
        return c.attention_bias and c.model_type != "qwen2"

    def __call__(self, x, cos, sin, kv_cache, md: AttentionMetadata):
        t = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        if self.lora is not None:
            q, k, v = self.lora.add(("q_proj", "k_proj", "v_proj"), x, (q, k, v), md.lora)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.sinks is None:
            out, kv_cache = self.attn(q, k, v, kv_cache, md)
        else:
            out, kv_cache = self.attn(q, k, v, kv_cache, md, sinks=self.sinks[...])
        out = out.reshape(t, -1)
        if self.lora is None:
            return project(out, self.o_proj)[0], kv_cache
        return self.lora.add(("o_proj",), out, project(out, self.o_proj), md.lora)[0], kv_cache

    @staticmethod
    def hf_weight_map(c: ModelConfig, path: tuple, prefix: str, qk_norm: bool):
        out = []
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((path + (proj, "kernel"), f"{prefix}{proj}.weight", True))
            if c.attention_bias and (proj != "o_proj" or LlamaAttention.output_bias(c)):
                out.append((path + (proj, "bias"), f"{prefix}{proj}.bias", False))
        if qk_norm:
            out += [(path + (norm, "weight"), f"{prefix}{norm}.weight", False) for norm in ("q_norm", "k_norm")]
        if c.model_type in SINK_MODELS:
            out.append((path + ("sinks",), f"{prefix}sinks", False))
        return out


class LlamaMLP(nnx.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU with silu, GeGLU with Gemma's tanh gelu."""

    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs, intermediate_size: int | None = None):
        size = intermediate_size or c.intermediate_size
        self.gate_proj = linear(c.hidden_size, size, False, dtype, rngs)
        self.up_proj = linear(c.hidden_size, size, False, dtype, rngs)
        self.down_proj = linear(size, c.hidden_size, False, dtype, rngs)
        self.act = activation(c.hidden_act)
        self.lora = None  # a `jpaged.models.lora.LoRAStack` when served with enable_lora

    def __call__(self, x, lora_inputs=None):
        """``lora_inputs``: the step's `LoRAInputs` (None: no adapters)."""
        gate, up = project(x, self.gate_proj, self.up_proj)
        if self.lora is None or lora_inputs is None:
            return project(self.act(gate) * up, self.down_proj)[0]
        gate, up = self.lora.add(("gate_proj", "up_proj"), x, (gate, up), lora_inputs)
        h = self.act(gate) * up
        return self.lora.add(("down_proj",), h, project(h, self.down_proj), lora_inputs)[0]

    @staticmethod
    def hf_weight_map(path: tuple, prefix: str):
        return [(path + (proj, "kernel"), f"{prefix}{proj}.weight", True)
                for proj in ("gate_proj", "up_proj", "down_proj")]


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, c: ModelConfig, layer: int, dtype, backend: str, rngs: nnx.Rngs, mlp: nnx.Module):
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.self_attn = LlamaAttention(c, layer, dtype, backend, rngs, qk_norm=c.model_type in QK_NORM_MODELS)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.mlp = mlp

    def __call__(self, x, cos, sin, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, md)
        x = x + h
        h = self.post_attention_layernorm(x)
        if getattr(self.mlp, "lora", None) is not None:  # a dense MLP served with adapters
            return x + self.mlp(h, md.lora), kv_cache
        return x + self.mlp(h), kv_cache


class LlamaForCausalLM(nnx.Module):
    """``__call__(input_ids[T], positions[T], kv_caches, md) -> (hidden[T, H], kv_caches)``;
    ``compute_logits(hidden[S, H]) -> [S, vocab]`` float32."""

    # config.json fields this family cannot honour (a ValueError names the one set)
    UNSUPPORTED = ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "local_rope_theta")

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs):
        c = self.config = config
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([LlamaDecoderLayer(c, i, dtype, attention_backend, rngs,
                                                  self.make_mlp(c, i, dtype, rngs)) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, rngs)
        self.inv_freq = nnx.Variable(jnp.asarray(self.rope_inv_freq()))

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        require_unset(config, cls.__name__, *cls.UNSUPPORTED)

    def rope_inv_freq(self):
        """The rotary inverse frequencies (a family with another rope scaling gives its own)."""
        return rope_inv_freq(self.config)

    def make_mlp(self, c: ModelConfig, layer: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Layer ``layer``'s MLP (the mixture-of-experts models give theirs)."""
        return LlamaMLP(c, dtype, rngs)

    def mlp_weight_map(self, layer: int, path: tuple, prefix: str):
        """(path, HF name, transpose?) of layer ``layer``'s MLP parameters under ``path`` / ``prefix``."""
        return LlamaMLP.hf_weight_map(path + ("mlp",), prefix + "mlp.")

    def init_buffers(self):
        """Recomputes non-parameter state (after creation under `nnx.eval_shape`)."""
        self.inv_freq.set_value(jnp.asarray(self.rope_inv_freq()))

    DECODER_LAYERS = "layers"

    def embed_inputs(self, input_ids, positions):
        """Token embeddings, and the rotary cos/sin every layer takes."""
        return self.embed_tokens(input_ids), rope_cos_sin(self.inv_freq[...], positions)

    def norm_output(self, x):
        return self.norm(x)

    def __call__(self, input_ids, positions, kv_caches, md: AttentionMetadata):
        x, extra = self.embed_inputs(input_ids, positions)
        x, new_caches = run_layers(self.layers, x, kv_caches, *extra, md)
        return self.norm_output(x), new_caches

    def compute_logits(self, hidden):
        return tied_or_head_logits(self.embed_tokens, self.lm_head, hidden)

    def hf_weight_map(self):
        """(module attribute path, HF tensor name, transpose?) for every parameter."""
        c = self.config
        out = [(("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
               (("norm", "weight"), "model.norm.weight", False)]
        if self.lm_head is not None:
            out.append((("lm_head", "kernel"), "lm_head.weight", True))
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            L = ("layers", i)
            out += [(L + ("input_layernorm", "weight"), p + "input_layernorm.weight", False),
                    (L + ("post_attention_layernorm", "weight"), p + "post_attention_layernorm.weight", False)]
            out += LlamaAttention.hf_weight_map(c, L + ("self_attn",), p + "self_attn.", c.model_type in QK_NORM_MODELS)
            out += self.mlp_weight_map(i, L, p)
        return out
