"""Gemma 2 and Gemma 3 text decoders (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``) in Flax NNX.

What sets them apart from Llama: token embeddings scaled by ``sqrt(hidden_size)``; RMS norms
whose weight is an offset from 1 (``x * (1 + w)`` in float32), four per layer (before and after
attention and the MLP); GeGLU (``gelu_pytorch_tanh``) MLPs; attention scaled by
``query_pre_attn_scalar ** -0.5``; interleaved sliding-window and global layers (``layer_types``,
or Gemma 2's every other layer and Gemma 3's every ``sliding_window_pattern``-th global); tied
embeddings. Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``) and the output
logits (``final_logit_softcapping``); Gemma 3 normalizes each head's q and k (unit-offset RMS
norms) and gives its sliding-window layers their own rope base (``rope_local_base_freq``), its
global layers the scaled one. As in transformers, Gemma 3's attention takes no soft cap.
"""
import jax.numpy as jnp
from flax import nnx

from jpaged.models.attention import AttentionMetadata
from jpaged.models.layers import RMSNorm, linear, rope_cos_sin, rope_inv_freq, run_layers, soft_cap, tied_or_head_logits
from jpaged.models.llama import LlamaAttention, LlamaMLP
from jpaged.models.model_config import ModelConfig

GEMMA3 = "gemma3_text"


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, c: ModelConfig, layer: int, dtype, backend: str, rngs: nnx.Rngs):
        def norm():
            return RMSNorm(c.hidden_size, c.norm_eps, dtype, unit_offset=True)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = LlamaAttention(c, layer, dtype, backend, rngs, qk_norm=c.model_type == GEMMA3,
                                        unit_offset=True)
        self.mlp = LlamaMLP(c, dtype, rngs)
        self.local_rope = c.window_of(layer) is not None and c.local_rope_theta is not None

    def __call__(self, x, rope, local_rope, kv_cache, md):
        cos, sin = local_rope if self.local_rope else rope
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, md)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), kv_cache


class GemmaForCausalLM(nnx.Module):
    """``__call__(input_ids[T], positions[T], kv_caches, md) -> (hidden[T, H], kv_caches)``;
    ``compute_logits(hidden[S, H]) -> [S, vocab]`` float32 (soft-capped where the config says)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs):
        c = self.config = config
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([GemmaDecoderLayer(c, i, dtype, attention_backend, rngs) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, dtype, unit_offset=True)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, rngs)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(c)))
        self.local_inv_freq = nnx.Variable(jnp.asarray(self._local_inv_freq()))

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        text = config.hf.get("text_config") or config.hf
        if text.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True: not supported (jpaged attends causally)")

    def _local_inv_freq(self):
        return rope_inv_freq(self.config, local=self.config.local_rope_theta is not None)

    def init_buffers(self):
        """Recomputes non-parameter state (after creation under `nnx.eval_shape`)."""
        self.inv_freq.set_value(jnp.asarray(rope_inv_freq(self.config)))
        self.local_inv_freq.set_value(jnp.asarray(self._local_inv_freq()))

    DECODER_LAYERS = "layers"

    def embed_inputs(self, input_ids, positions):
        """Scaled token embeddings, and the rotary cos/sin of the global and the local layers."""
        x = self.embed_tokens(input_ids)
        x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        return x, (rope_cos_sin(self.inv_freq[...], positions), rope_cos_sin(self.local_inv_freq[...], positions))

    def norm_output(self, x):
        return self.norm(x)

    def __call__(self, input_ids, positions, kv_caches, md: AttentionMetadata):
        x, extra = self.embed_inputs(input_ids, positions)
        x, new_caches = run_layers(self.layers, x, kv_caches, *extra, md)
        return self.norm_output(x), new_caches

    def compute_logits(self, hidden):
        return soft_cap(tied_or_head_logits(self.embed_tokens, self.lm_head, hidden), self.config.final_logit_softcap)

    def hf_weight_map(self):
        """(module attribute path, HF tensor name, transpose?) for every parameter."""
        c = self.config
        out = [(("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
               (("norm", "weight"), "model.norm.weight", False)]
        if self.lm_head is not None:
            out.append((("lm_head", "kernel"), "lm_head.weight", True))
        for i in range(c.num_layers):
            p, L = f"model.layers.{i}.", ("layers", i)
            out += [(L + (norm, "weight"), f"{p}{norm}.weight", False)
                    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                 "post_feedforward_layernorm")]
            out += LlamaAttention.hf_weight_map(c, L + ("self_attn",), p + "self_attn.", c.model_type == GEMMA3)
            out += LlamaMLP.hf_weight_map(L + ("mlp",), p + "mlp.")
        return out
