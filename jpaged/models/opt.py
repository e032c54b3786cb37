"""OPT (OPTForCausalLM) in Flax NNX, attending through the paged KV cache.

Learned positions with OPT's offset of 2 (row ``position + 2`` of ``embed_positions``), LayerNorm
before each sub-block (125m, 1.3b, ...) or after it (350m: ``do_layer_norm_before=False``, no final
LayerNorm), biases (``enable_bias``), ReLU, ``project_in``/``project_out`` when
``word_embed_proj_dim != hidden_size`` (350m), tied lm_head. The query is scaled before attention,
as transformers does. `canonical_hf_name` accepts both ``model.decoder.*`` (save_pretrained of
OPTForCausalLM) and ``decoder.*`` (the original Hub files of OPTModel).
"""
import jax.numpy as jnp
from flax import nnx

from jpaged.models.attention import AttentionMetadata, PagedAttention
from jpaged.models.layers import LayerNorm, activation, linear, project, run_layers, tied_or_head_logits
from jpaged.models.model_config import ModelConfig

POSITION_OFFSET = 2


class OPTAttention(nnx.Module):
    def __init__(self, c: ModelConfig, bias: bool, dtype, backend: str, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.q_proj = linear(c.hidden_size, c.hidden_size, bias, dtype, rngs)
        self.k_proj = linear(c.hidden_size, c.hidden_size, bias, dtype, rngs)
        self.v_proj = linear(c.hidden_size, c.hidden_size, bias, dtype, rngs)
        self.out_proj = linear(c.hidden_size, c.hidden_size, bias, dtype, rngs)
        self.scaling = c.head_dim ** -0.5
        self.attn = PagedAttention(c.num_heads, c.num_heads, c.head_dim, scale=1.0, backend=backend)

    def __call__(self, x, kv_cache, md: AttentionMetadata):
        t = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = (q * self.scaling).reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_heads, self.head_dim)
        v = v.reshape(t, self.num_heads, self.head_dim)
        out, kv_cache = self.attn(q, k, v, kv_cache, md)
        return self.out_proj(out.reshape(t, -1)), kv_cache


class OPTDecoderLayer(nnx.Module):
    def __init__(self, c: ModelConfig, dtype, backend: str, rngs: nnx.Rngs):
        hf = c.hf
        bias, affine = hf.get("enable_bias", True), hf.get("layer_norm_elementwise_affine", True)
        self.pre_norm = hf.get("do_layer_norm_before", True)
        self.self_attn = OPTAttention(c, bias, dtype, backend, rngs)
        self.self_attn_layer_norm = LayerNorm(c.hidden_size, c.norm_eps, dtype, affine)
        self.fc1 = linear(c.hidden_size, c.intermediate_size, bias, dtype, rngs)
        self.fc2 = linear(c.intermediate_size, c.hidden_size, bias, dtype, rngs)
        self.final_layer_norm = LayerNorm(c.hidden_size, c.norm_eps, dtype, affine)
        self.act = activation(c.hidden_act)

    def __call__(self, x, kv_cache, md):
        h, kv_cache = self.self_attn(self.self_attn_layer_norm(x) if self.pre_norm else x, kv_cache, md)
        x = x + h
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.fc2(self.act(self.fc1(self.final_layer_norm(x) if self.pre_norm else x)))
        x = x + h
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x, kv_cache


class OPTForCausalLM(nnx.Module):
    """``__call__(input_ids[T], positions[T], kv_caches, md) -> (hidden[T, H], kv_caches)``;
    ``compute_logits(hidden[S, H]) -> [S, vocab]`` float32 (``project_out`` is applied there)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs):
        c = self.config = config
        hf = c.hf
        if c.num_kv_heads != c.num_heads or c.head_dim * c.num_heads != c.hidden_size:
            raise ValueError(f"OPT needs num_kv_heads == num_heads and head_dim * num_heads == "
                             f"hidden_size (got {c.num_kv_heads}, {c.num_heads}, {c.head_dim}, {c.hidden_size})")
        self.embed_dim = hf.get("word_embed_proj_dim") or c.hidden_size
        affine = hf.get("layer_norm_elementwise_affine", True)
        self.embed_tokens = nnx.Embed(c.vocab_size, self.embed_dim, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.embed_positions = nnx.Embed(c.max_position_embeddings + POSITION_OFFSET, c.hidden_size,
                                         dtype=dtype, param_dtype=dtype, rngs=rngs)
        projected = self.embed_dim != c.hidden_size
        self.project_in = linear(self.embed_dim, c.hidden_size, False, dtype, rngs) if projected else None
        self.project_out = linear(c.hidden_size, self.embed_dim, False, dtype, rngs) if projected else None
        self.layers = nnx.List([OPTDecoderLayer(c, dtype, attention_backend, rngs) for _ in range(c.num_layers)])
        has_final_norm = hf.get("do_layer_norm_before", True) and not hf.get("_remove_final_layer_norm", False)
        self.final_layer_norm = LayerNorm(c.hidden_size, c.norm_eps, dtype, affine) if has_final_norm else None
        self.lm_head = None if c.tie_word_embeddings else linear(self.embed_dim, c.vocab_size, False, dtype, rngs)

    def init_buffers(self):
        """No non-parameter state."""

    DECODER_LAYERS = "layers"

    def embed_inputs(self, input_ids, positions):
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        return x + self.embed_positions(positions + POSITION_OFFSET), ()

    def norm_output(self, x):
        return x if self.final_layer_norm is None else self.final_layer_norm(x)

    def __call__(self, input_ids, positions, kv_caches, md: AttentionMetadata):
        x, _ = self.embed_inputs(input_ids, positions)
        x, new_caches = run_layers(self.layers, x, kv_caches, md)
        return self.norm_output(x), new_caches

    def compute_logits(self, hidden):
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return tied_or_head_logits(self.embed_tokens, self.lm_head, hidden)

    @staticmethod
    def canonical_hf_name(name: str) -> str:
        """``decoder.layers.0...`` (Hub files of OPTModel) -> ``model.decoder.layers.0...``."""
        return "model." + name if name.startswith("decoder.") else name

    def hf_weight_map(self):
        """(module attribute path, HF tensor name, transpose?) for every parameter."""
        d = "model.decoder."
        out = [(("embed_tokens", "embedding"), d + "embed_tokens.weight", False),
               (("embed_positions", "embedding"), d + "embed_positions.weight", False)]
        for proj in ("project_in", "project_out"):
            if getattr(self, proj) is not None:
                out.append(((proj, "kernel"), f"{d}{proj}.weight", True))
        if self.final_layer_norm is not None and self.final_layer_norm.weight is not None:
            out += [(("final_layer_norm", "weight"), d + "final_layer_norm.weight", False),
                    (("final_layer_norm", "bias"), d + "final_layer_norm.bias", False)]
        if self.lm_head is not None:
            out.append((("lm_head", "kernel"), "lm_head.weight", True))
        affine = self.config.hf.get("layer_norm_elementwise_affine", True)
        bias = self.config.hf.get("enable_bias", True)
        for i in range(self.config.num_layers):
            p = f"{d}layers.{i}."
            L = ("layers", i)
            if affine:
                for ln in ("self_attn_layer_norm", "final_layer_norm"):
                    out += [(L + (ln, "weight"), f"{p}{ln}.weight", False),
                            (L + (ln, "bias"), f"{p}{ln}.bias", False)]
            linears = [("self_attn", proj) for proj in ("q_proj", "k_proj", "v_proj", "out_proj")]
            for mod in linears + [("fc1",), ("fc2",)]:
                name = p + ".".join(mod)
                out.append((L + mod + ("kernel",), name + ".weight", True))
                if bias:
                    out.append((L + mod + ("bias",), name + ".bias", False))
        return out
