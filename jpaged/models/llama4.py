"""Llama 4 text (``Llama4ForCausalLM``): the Llama decoder with chunked local attention, NoPE
global layers and a mixture of experts with a shared expert.

- Attention: layers with rope (``no_rope_layers[i] == 1``; 3 of every 4 by default) attend within
  ``attention_chunk_size`` chunks (``layer_types`` "chunked_attention": a query at position p sees
  the keys ``p // chunk * chunk <= j <= p``), their q and k L2-normalized after rope with
  ``use_qk_norm``; rope is applied to interleaved pairs ``(x[2i], x[2i + 1])`` (transformers'
  complex rotation). The others ("full_attention") have no rope and, with
  ``attn_temperature_tuning``, scale each query by ``log1p(floor((p + 1) / floor_scale)) *
  attn_scale + 1``.
- MLP: layers in ``moe_layers`` (every ``interleave_moe_layer_step``-th) route each token to its top
  ``num_experts_per_tok`` (1) of ``num_local_experts`` experts by logit and feed the expert the
  token scaled by the sigmoid of its logit (the scale goes in, not out), plus a shared SwiGLU
  expert of ``intermediate_size`` on every token; the other layers have a dense SwiGLU of
  ``intermediate_size_mlp``.
- Weights: each fused ``experts.gate_up_proj [E, hidden, 2 * intermediate]`` (gate first, up
  second) is split into ``gate_proj`` and ``up_proj`` at load.

Chunked layers run on either attention backend (the Pallas kernels start each query at its
chunk's first page; the xla backend's jnp loops mask the same keys); their KV blocks are managed
like a global layer's (all kept).
"""
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jpaged.models.attention import AttentionMetadata, PagedAttention
from jpaged.models.layers import RMSNorm, linear, project, rope_inv_freq
from jpaged.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from jpaged.models.mixtral import experts_per_token, num_experts
from jpaged.models.model_config import ModelConfig
from jpaged.models.moe import SparseMoE

LAYER_TYPES = ("chunked_attention", "full_attention")


def _text(c: ModelConfig) -> dict:
    return c.hf.get("text_config") or c.hf


def uses_rope(c: ModelConfig, layer: int) -> bool:
    text = _text(c)
    flags = text.get("no_rope_layers") or [int((i + 1) % text.get("no_rope_layer_interval", 4) != 0)
                                           for i in range(c.num_layers)]
    return bool(flags[layer])


def layer_chunk(c: ModelConfig, layer: int) -> int | None:
    """Layer ``layer``'s attention chunk (None: full attention)."""
    text = _text(c)
    chunk = text.get("attention_chunk_size")
    types = text.get("layer_types") or ["chunked_attention" if uses_rope(c, i) and chunk is not None
                                        else "full_attention" for i in range(c.num_layers)]
    return chunk if types[layer] == "chunked_attention" else None


def moe_layers(c: ModelConfig) -> list[int]:
    text = _text(c)
    step = text.get("interleave_moe_layer_step", 1)
    layers = text.get("moe_layers")
    return list(range(step - 1, c.num_layers, step)) if layers is None else list(layers)


def interleaved_rope(x, cos, sin):
    """x [T, H, D] rotated pair by pair, ``(x[2i], x[2i + 1])`` by the angle of frequency i; cos/sin
    [T, D / 2]."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def l2_norm(x, eps: float):
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Llama4Attention(LlamaAttention):
    """`LlamaAttention`'s projections with Llama 4's rope, qk norm, temperature and chunks."""

    def __init__(self, c: ModelConfig, layer: int, dtype, backend: str, rngs: nnx.Rngs):
        super().__init__(c, layer, dtype, backend, rngs)
        text = _text(c)
        self.use_rope = uses_rope(c, layer)
        self.qk_norm_eps = c.norm_eps if self.use_rope and text.get("use_qk_norm", True) else None
        self.temperature = not self.use_rope and text.get("attn_temperature_tuning", True)
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.head_dim, backend=backend,
                                   attention_chunk=layer_chunk(c, layer))

    def __call__(self, x, cos, sin, q_scale, kv_cache, md: AttentionMetadata):
        t = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = interleaved_rope(q, cos, sin), interleaved_rope(k, cos, sin)
        if self.qk_norm_eps is not None:
            q, k = l2_norm(q, self.qk_norm_eps), l2_norm(k, self.qk_norm_eps)
        if self.temperature:
            q = (q * q_scale[:, None, None]).astype(q.dtype)
        out, kv_cache = self.attn(q, k, v, kv_cache, md)
        return project(out.reshape(t, -1), self.o_proj)[0], kv_cache


class Llama4MoE(SparseMoE):
    """Routed experts (sigmoid-scaled inputs, top-k by logit) plus a shared SwiGLU expert."""

    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs, expert_parallel: bool = False):
        super().__init__(c.hidden_size, c.intermediate_size, num_experts(c), experts_per_token(c), normalize=False,
                         hidden_act=c.hidden_act, dtype=dtype, rngs=rngs, expert_parallel=expert_parallel)
        self.shared_expert = LlamaMLP(c, dtype, rngs)

    def route(self, x):
        """(expert ids [T, k], sigmoid of their logits [T, k] float32)."""
        logits = jnp.dot(x, self.router[...]).astype(jnp.float32)
        top, expert_ids = lax.top_k(logits, self.top_k)
        return expert_ids, jax.nn.sigmoid(top)

    def __call__(self, x):
        expert_ids, scores = self.route(x)
        t, k = expert_ids.shape
        # each (token, expert) pair is one row whose input is scaled by its score
        rows = (x[:, None, :] * scores[..., None].astype(x.dtype)).reshape(t * k, -1)
        routed = self.run_experts(rows, expert_ids.reshape(-1, 1), jnp.ones((t * k, 1), jnp.float32))
        routed = jnp.take_along_axis(routed.reshape(t, k, -1), jnp.argsort(expert_ids, axis=-1)[..., None], axis=1)
        out = routed[:, 0]
        for j in range(1, k):  # in expert order, as transformers adds them
            out = out + routed[:, j]
        return self.shared_expert(x) + out


class Llama4DecoderLayer(nnx.Module):
    def __init__(self, c: ModelConfig, layer: int, dtype, backend: str, rngs: nnx.Rngs, mlp: nnx.Module):
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.self_attn = Llama4Attention(c, layer, dtype, backend, rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.mlp = mlp

    def __call__(self, x, cos, sin, q_scale, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, q_scale, kv_cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class Llama4ForCausalLM(LlamaForCausalLM):
    """``__call__(input_ids[T], positions[T], kv_caches, md) -> (hidden[T, H], kv_caches)``;
    ``compute_logits(hidden[S, H]) -> [S, vocab]`` float32."""

    HAS_EXPERTS = True

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs, expert_parallel: bool = False):
        c = self.config = config
        self.expert_parallel = expert_parallel
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Llama4DecoderLayer(c, i, dtype, attention_backend, rngs, self.make_mlp(c, i, dtype, rngs))
                                for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, rngs)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(c)))

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        text = _text(config)
        bad = sorted(set(text.get("layer_types") or []) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types: {bad} not supported by Llama4ForCausalLM (it runs {list(LAYER_TYPES)})")
        if "chunked_attention" in (text.get("layer_types") or []) and not text.get("attention_chunk_size"):
            raise ValueError("attention_chunk_size: layer_types has chunked_attention layers but no chunk size")
        if text.get("router_jitter_noise"):
            raise ValueError(f"router_jitter_noise={text['router_jitter_noise']!r}: a training option, not supported")
        if config.attention_bias:
            raise ValueError("attention_bias=True: Llama4ForCausalLM has no attention biases")
        num_experts(config)

    def make_mlp(self, c: ModelConfig, layer: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
        if layer in moe_layers(c):
            return Llama4MoE(c, dtype, rngs, self.expert_parallel)
        return LlamaMLP(c, dtype, rngs, intermediate_size=_text(c).get("intermediate_size_mlp") or c.intermediate_size)

    def embed_inputs(self, input_ids, positions):
        """Token embeddings; the rope cos/sin [T, head_dim / 2] and the NoPE layers' query scale [T]."""
        freqs = positions.astype(jnp.float32)[:, None] * self.inv_freq[...][None, :]
        text = _text(self.config)
        floor_scale, attn_scale = text.get("floor_scale", 8192), text.get("attn_scale", 0.1)
        q_scale = jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)) * attn_scale + 1.0
        return self.embed_tokens(input_ids), (jnp.cos(freqs), jnp.sin(freqs), q_scale)

    def mlp_weight_map(self, layer: int, path: tuple, prefix: str):
        mlp, p = path + ("mlp",), prefix + "feed_forward."
        if layer not in moe_layers(self.config):
            return LlamaMLP.hf_weight_map(mlp, p)
        out = [(mlp + ("router",), p + "router.weight", True)]
        out += [(mlp + ("experts", ours), f"{p}experts.{theirs}", False)
                for ours, theirs in (("gate_proj", "gate_up_proj[gate]"), ("up_proj", "gate_up_proj[up]"),
                                     ("down_proj", "down_proj"))]
        return out + LlamaMLP.hf_weight_map(mlp + ("shared_expert",), p + "shared_expert.")

    def hf_weight_map(self):
        c = self.config
        out = [(("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
               (("norm", "weight"), "model.norm.weight", False)]
        if self.lm_head is not None:
            out.append((("lm_head", "kernel"), "lm_head.weight", True))
        for i in range(c.num_layers):
            p, L = f"model.layers.{i}.", ("layers", i)
            out += [(L + (norm, "weight"), p + norm + ".weight", False)
                    for norm in ("input_layernorm", "post_attention_layernorm")]
            out += LlamaAttention.hf_weight_map(c, L + ("self_attn",), p + "self_attn.", False)
            out += self.mlp_weight_map(i, L, p)
        return out

    @staticmethod
    def convert_hf_weights(weights):
        """Each fused ``experts.gate_up_proj`` split into its gate (first half of the columns) and up
        (second half), as `hf_weight_map` names them."""
        for name, array in weights:
            if name.endswith(".experts.gate_up_proj"):
                half = array.shape[-1] // 2
                yield f"{name}[gate]", array[..., :half]
                yield f"{name}[up]", array[..., half:]
            else:
                yield name, array
