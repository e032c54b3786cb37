"""GPT-2 (GPT2LMHeadModel) in Flax NNX: learned positions, pre-LayerNorm blocks, a fused q/k/v
projection and GELU, attending through the paged KV cache.

HF's Conv1D stores weights as ``[in, out]``, the layout of ``nnx.Linear``'s kernel, so nothing is
transposed on load. Checkpoints written by ``GPT2LMHeadModel.save_pretrained`` name tensors
``transformer.h.0...``; the original OpenAI/Hub files name them ``h.0...``: `canonical_hf_name`
maps both to the first spelling.
"""
import jax.numpy as jnp
from flax import nnx

from jpaged.models.attention import AttentionMetadata, PagedAttention
from jpaged.models.layers import LayerNorm, activation, linear, run_layers, tied_or_head_logits
from jpaged.models.model_config import ModelConfig

class GPT2Attention(nnx.Module):
    def __init__(self, c: ModelConfig, layer_idx: int, dtype, backend: str, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.c_attn = linear(c.hidden_size, 3 * c.hidden_size, True, dtype, rngs)  # [q | k | v] columns
        self.c_proj = linear(c.hidden_size, c.hidden_size, True, dtype, rngs)
        scale = c.head_dim ** -0.5 if c.hf.get("scale_attn_weights", True) else 1.0
        if c.hf.get("scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.attn = PagedAttention(c.num_heads, c.num_heads, c.head_dim, scale=scale, backend=backend)

    def __call__(self, x, kv_cache, md: AttentionMetadata):
        t = x.shape[0]
        qkv = self.c_attn(x).reshape(t, 3, self.num_heads, self.head_dim)
        out, kv_cache = self.attn(qkv[:, 0], qkv[:, 1], qkv[:, 2], kv_cache, md)
        return self.c_proj(out.reshape(t, -1)), kv_cache


class GPT2MLP(nnx.Module):
    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs):
        self.c_fc = linear(c.hidden_size, c.intermediate_size, True, dtype, rngs)
        self.c_proj = linear(c.intermediate_size, c.hidden_size, True, dtype, rngs)
        self.act = activation(c.hidden_act)

    def __call__(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nnx.Module):
    def __init__(self, c: ModelConfig, layer_idx: int, dtype, backend: str, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(c.hidden_size, c.norm_eps, dtype)
        self.attn = GPT2Attention(c, layer_idx, dtype, backend, rngs)
        self.ln_2 = LayerNorm(c.hidden_size, c.norm_eps, dtype)
        self.mlp = GPT2MLP(c, dtype, rngs)

    def __call__(self, x, kv_cache, md):
        h, kv_cache = self.attn(self.ln_1(x), kv_cache, md)
        x = x + h
        return x + self.mlp(self.ln_2(x)), kv_cache


class GPT2LMHeadModel(nnx.Module):
    """``__call__(input_ids[T], positions[T], kv_caches, md) -> (hidden[T, H], kv_caches)``;
    ``compute_logits(hidden[S, H]) -> [S, vocab]`` float32."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs):
        c = self.config = config
        if c.hf.get("add_cross_attention"):
            raise ValueError("GPT-2 with add_cross_attention=True is an encoder-decoder part, not a "
                             "causal LM; it is not supported")
        if c.num_kv_heads != c.num_heads or c.head_dim * c.num_heads != c.hidden_size:
            raise ValueError(f"GPT-2 needs num_kv_heads == num_heads and head_dim * num_heads == "
                             f"hidden_size (got {c.num_kv_heads}, {c.num_heads}, {c.head_dim}, {c.hidden_size})")
        self.wte = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.wpe = nnx.Embed(c.max_position_embeddings, c.hidden_size, dtype=dtype, param_dtype=dtype,
                             rngs=rngs)
        self.h = nnx.List([GPT2Block(c, i, dtype, attention_backend, rngs) for i in range(c.num_layers)])
        self.ln_f = LayerNorm(c.hidden_size, c.norm_eps, dtype)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, rngs)

    def init_buffers(self):
        """No non-parameter state."""

    DECODER_LAYERS = "h"

    def embed_inputs(self, input_ids, positions):
        return self.wte(input_ids) + self.wpe(positions), ()

    def norm_output(self, x):
        return self.ln_f(x)

    def __call__(self, input_ids, positions, kv_caches, md: AttentionMetadata):
        x, _ = self.embed_inputs(input_ids, positions)
        x, new_caches = run_layers(self.h, x, kv_caches, md)
        return self.norm_output(x), new_caches

    def compute_logits(self, hidden):
        return tied_or_head_logits(self.wte, self.lm_head, hidden)

    @staticmethod
    def canonical_hf_name(name: str) -> str:
        """``h.0.ln_1.weight`` (Hub files of GPT2Model) -> ``transformer.h.0.ln_1.weight``."""
        if name.startswith(("transformer.", "lm_head.")):
            return name
        return "transformer." + name

    def hf_weight_map(self):
        """(module attribute path, HF tensor name, transpose?) for every parameter."""
        out = [(("wte", "embedding"), "transformer.wte.weight", False),
               (("wpe", "embedding"), "transformer.wpe.weight", False),
               (("ln_f", "weight"), "transformer.ln_f.weight", False),
               (("ln_f", "bias"), "transformer.ln_f.bias", False)]
        if self.lm_head is not None:
            out.append((("lm_head", "kernel"), "lm_head.weight", True))
        for i in range(self.config.num_layers):
            p = f"transformer.h.{i}."
            L = ("h", i)
            for ln in ("ln_1", "ln_2"):
                out += [(L + (ln, "weight"), f"{p}{ln}.weight", False),
                        (L + (ln, "bias"), f"{p}{ln}.bias", False)]
            for mod, proj in (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")):
                out += [(L + (mod, proj, "kernel"), f"{p}{mod}.{proj}.weight", False),  # Conv1D: [in, out]
                        (L + (mod, proj, "bias"), f"{p}{mod}.{proj}.bias", False)]
        return out
