"""Llama-family decoder in Flax NNX: Llama 2/3 (GQA, Llama 3.1 rope scaling), Mistral,
Qwen2 (q/k/v biases) and SmolLM2 (tied embeddings), attending through the paged KV cache."""
import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.models.attention import AttentionMetadata, PagedAttention
from jpaged.models.layers import (RMSNorm, apply_rope, linear, project, rope_inv_freq, run_layers,
                                  tied_or_head_logits)
from jpaged.models.model_config import ModelConfig


class LlamaAttention(nnx.Module):
    def __init__(self, c: ModelConfig, dtype, backend: str, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = linear(c.hidden_size, c.num_heads * c.head_dim, c.attention_bias, dtype, rngs)
        self.k_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.attention_bias, dtype, rngs)
        self.v_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.attention_bias, dtype, rngs)
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, False, dtype, rngs)
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.head_dim, backend=backend)

    def __call__(self, x, cos, sin, kv_cache, md: AttentionMetadata):
        t = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = apply_rope(q.reshape(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        out, kv_cache = self.attn(q, k, v, kv_cache, md)
        return self.o_proj(out.reshape(t, -1)), kv_cache


class LlamaMLP(nnx.Module):
    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(c.hidden_size, c.intermediate_size, False, dtype, rngs)
        self.up_proj = linear(c.hidden_size, c.intermediate_size, False, dtype, rngs)
        self.down_proj = linear(c.intermediate_size, c.hidden_size, False, dtype, rngs)

    def __call__(self, x):
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(jax.nn.silu(gate) * up)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, c: ModelConfig, dtype, backend: str, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.self_attn = LlamaAttention(c, dtype, backend, rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.mlp = LlamaMLP(c, dtype, rngs)

    def __call__(self, x, cos, sin, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class LlamaForCausalLM(nnx.Module):
    """``__call__(input_ids[T], positions[T], kv_caches, md) -> (hidden[T, H], kv_caches)``;
    ``compute_logits(hidden[S, H]) -> [S, vocab]`` float32."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs):
        c = self.config = config
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([LlamaDecoderLayer(c, dtype, attention_backend, rngs)
                                for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, rngs)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(c)))

    def init_buffers(self):
        """Recomputes non-parameter state (after creation under `nnx.eval_shape`)."""
        self.inv_freq.set_value(jnp.asarray(rope_inv_freq(self.config)))

    DECODER_LAYERS = "layers"

    def embed_inputs(self, input_ids, positions):
        """Token embeddings, and the rotary cos/sin every layer takes."""
        freqs = positions.astype(jnp.float32)[:, None] * self.inv_freq[...][None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return self.embed_tokens(input_ids), (jnp.cos(emb), jnp.sin(emb))

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
        out = [(("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
               (("norm", "weight"), "model.norm.weight", False)]
        if self.lm_head is not None:
            out.append((("lm_head", "kernel"), "lm_head.weight", True))
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            L = ("layers", i)
            out += [(L + ("input_layernorm", "weight"), p + "input_layernorm.weight", False),
                    (L + ("post_attention_layernorm", "weight"), p + "post_attention_layernorm.weight", False)]
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out.append((L + ("self_attn", proj, "kernel"), f"{p}self_attn.{proj}.weight", True))
                if self.config.attention_bias and proj != "o_proj":
                    out.append((L + ("self_attn", proj, "bias"), f"{p}self_attn.{proj}.bias", False))
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out.append((L + ("mlp", proj, "kernel"), f"{p}mlp.{proj}.weight", True))
        return out
