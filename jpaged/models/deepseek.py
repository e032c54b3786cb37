"""DeepSeek-V2 / V3 / R1 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): multi-head latent
attention over a latent paged KV cache, and mixture-of-experts MLPs with shared experts.

Attention (MLA). Per token the layer caches one latent row ``[c_kv, k_pe]``: ``c_kv`` is the
normed ``kv_lora_rank`` compression of the hidden state, ``k_pe`` the ``qk_rope_head_dim`` rope key
shared by all heads. The up-projection ``kv_b_proj`` (per head: ``W_UK [nope, R]`` and ``W_UV [v,
R]``) is absorbed: each head's no-rope query becomes ``q_nope @ W_UK`` in the latent space, so a
score is ``[q_nope @ W_UK, q_pe] . [c_kv, k_pe]``, and the head's output is ``W_UV`` applied to
the softmax-weighted sum of ``c_kv``. The kernel (`pallas_kernels.paged_mla`) thus reads each
latent page once for every head, and the pool holds ``kv_lora_rank + qk_rope_head_dim`` values
per token and layer (576 for V3) instead of ``2 * heads * head_dim``. Prefill runs the same
absorbed attention (one kernel, one cache format).

Rope: ``qk_rope_head_dim`` dims, interleaved pairs (V2 always, V3 with ``rope_interleave``), the
default or YaRN frequencies; YaRN's ``attention_factor`` scales cos/sin and ``mscale_all_dim``
the softmax scale, as transformers does.

MLP: layers below ``first_k_dense_replace`` are dense SwiGLU; the others route each token to
``num_experts_per_tok`` of ``n_routed_experts`` (`jpaged.models.moe`) and add ``n_shared_experts``
shared experts (one SwiGLU of ``n_shared_experts * moe_intermediate_size``). Routing: V3's
``noaux_tc`` (sigmoid scores; groups ranked by their top-2 scores plus ``e_score_correction_bias``,
the best ``topk_group`` of ``n_group`` kept, top-k by biased score, weights the unbiased scores,
renormalized with ``norm_topk_prob``), V2's softmax ``greedy`` / ``group_limited_greedy``; weights
times ``routed_scaling_factor``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jpaged import sharding
from jpaged.models.attention import BACKENDS, AttentionMetadata, PagedAttention, _interpret
from jpaged.models.layers import RMSNorm, apply_rope, linear, project, rope_cos_sin, yarn_frequencies, yarn_mscale
from jpaged.models.llama import LlamaForCausalLM, LlamaMLP
from jpaged.models.model_config import ModelConfig, latent_row_width
from jpaged.models.moe import SparseMoE
from jpaged.models.quantized import QuantizedLinear
from pallas_kernels import paged_mla

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm use their default eps
ROUTING = {"deepseek_v3": ("noaux_tc",), "deepseek_v2": ("greedy", "group_limited_greedy")}
ROPE_TYPES = ("default", "yarn")


def _text(c: ModelConfig) -> dict:
    return c.hf.get("text_config") or c.hf


def _topk_method(c: ModelConfig) -> str:
    return _text(c).get("topk_method") or ROUTING[c.model_type][0]


def rope_parameters(c: ModelConfig) -> tuple[np.ndarray, float, float]:
    """(inverse frequencies [qk_rope_head_dim / 2], the cos/sin factor, the softmax-scale factor)
    of the rope dims: the default frequencies, or YaRN's blend of interpolated and extrapolated
    ones with its ``attention_factor`` and ``mscale_all_dim`` (transformers' formulas)."""
    dim = _text(c)["qk_rope_head_dim"]
    base = c.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    rope = c.rope_scaling
    if rope is None:
        return (1.0 / pos_freqs).astype(np.float32), 1.0, 1.0
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings") or c.max_position_embeddings
    if factor is None:
        factor = c.max_position_embeddings / original
    inv_freq, attention_factor = yarn_frequencies(rope, dim, base, original, factor)
    mscale_all_dim = rope.get("mscale_all_dim")
    softmax_factor = yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return inv_freq.astype(np.float32), float(attention_factor), float(softmax_factor)


def deinterleave(x):
    """Interleaved rope pairs ``(x0, x1), (x2, x3), ...`` -> ``[x0, x2, ..., x1, x3, ...]``, the
    rotate-half layout of `apply_rope` (the same permutation of q and k keeps every score)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class PagedMLA(PagedAttention):
    """Writes this step's latent rows into the latent pool and attends through it.

    Call with ``q [T, H, W]`` (latent-space queries, `pallas_kernels.paged_mla`), ``latent [T,
    W]``, this layer's ``(k_pages, v_pages)`` (the rows' halves) and the step's metadata; returns
    ``[T, H, kv_lora_rank]`` and the updated cache. A `PagedAttention` without a window, so the
    engine's KV-cache layout sees one full-attention layer."""

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, *, scale: float, backend: str = "xla"):
        super().__init__(num_heads, 1, (kv_lora_rank + rope_dim) // 2, scale=scale, backend=backend)
        self.kv_lora_rank = kv_lora_rank

    def attend(self, q, k_pages, v_pages, md: AttentionMetadata):
        knobs = dict(kv_lora_rank=self.kv_lora_rank, scale=self.scale)
        if self.backend == "pallas" and md.decode_only:  # token s is sequence s's one query
            t, s = q.shape[0], md.seq_lens.shape[0]
            q_rows = q[:s] if t >= s else jnp.pad(q, ((0, s - t), (0, 0), (0, 0)))
            out = paged_mla.mla_paged_decode(q_rows, k_pages, v_pages, md.block_tables, md.seq_lens,
                                             interpret=_interpret(), **knobs)
            return out[:t] if s >= t else jnp.pad(out, ((0, t - s), (0, 0), (0, 0)))
        return paged_mla.mla_paged_attention_reference(q, k_pages, v_pages, md.block_tables, md.seq_lens,
                                                       md.query_start_loc, md.num_seqs, **knobs)

    def __call__(self, q, latent, kv_cache, md: AttentionMetadata):
        write = BACKENDS[self.backend][0]
        if len(kv_cache) != 2:
            raise ValueError("kv_cache_dtype: 8-bit KV pages are not supported with multi-head latent attention "
                             "(DeepSeek); the latent pool keeps the model dtype")

        def write_and_attend(q, latent, kv_cache, md):
            k_new, v_new = paged_mla.split_latent(latent, kv_cache[0].shape[0])
            kv_cache = tuple(write(*kv_cache, k_new, v_new, md.slot_mapping))
            return self.attend(q, *kv_cache, md), kv_cache

        if sharding.model_axis_size() > 1:  # heads split; each device holds a replica of the latent pool
            heads, pool, replicated = sharding.HEADS, sharding.POOL, sharding.REPLICATED
            write_and_attend = sharding.shard_heads(write_and_attend, (heads, replicated, pool, replicated),
                                                    (heads, pool))
        return write_and_attend(q, latent, tuple(kv_cache), md)


class MLAAttention(nnx.Module):
    """DeepSeek's attention: low-rank q (``q_lora_rank``; None: one ``q_proj``), the latent
    ``kv_a_proj_with_mqa``, the absorbed ``kv_b_proj``, `PagedMLA`, ``o_proj``."""

    def __init__(self, c: ModelConfig, dtype, backend: str, rngs: nnx.Rngs):
        t = _text(c)
        h, bias = c.num_heads, c.attention_bias
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = h, t.get("q_lora_rank"), t["kv_lora_rank"]
        self.nope, self.rope, self.v_dim = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
        self.interleaved = c.model_type == "deepseek_v2" or bool(t.get("rope_interleave", True))
        qk = self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = linear(c.hidden_size, self.q_lora_rank, bias, dtype, rngs)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = linear(self.q_lora_rank, h * qk, False, dtype, rngs)
        else:
            self.q_proj = linear(c.hidden_size, h * qk, False, dtype, rngs)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, self.kv_lora_rank + self.rope, bias, dtype, rngs)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = linear(self.kv_lora_rank, h * (self.nope + self.v_dim), False, dtype, rngs)
        self.o_proj = linear(h * self.v_dim, c.hidden_size, bias, dtype, rngs)
        scale = qk ** -0.5 * rope_parameters(c)[2]
        self.attn = PagedMLA(h, self.kv_lora_rank, self.rope, scale=scale, backend=backend)

    def query(self, x):
        if self.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def __call__(self, x, cos, sin, kv_cache, md: AttentionMetadata):
        t, h, r = x.shape[0], self.num_heads, self.kv_lora_rank
        q = self.query(x).reshape(t, h, self.nope + self.rope)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        (compressed,) = project(x, self.kv_a_proj_with_mqa)
        c_kv, k_pe = self.kv_a_layernorm(compressed[:, :r]), compressed[:, None, r:]
        if self.interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
        w = self.up_projection().reshape(r, h, self.nope + self.v_dim)  # [R, H, nope + v]
        q_latent = jnp.einsum("thn,rhn->thr", q_nope, w[..., :self.nope])
        latent = jnp.concatenate([c_kv, k_pe[:, 0]], axis=-1)                 # [T, R + rope]
        out, kv_cache = self.attn(jnp.concatenate([q_latent, q_pe], axis=-1), latent, kv_cache, md)
        out = jnp.einsum("thr,rhv->thv", out, w[..., self.nope:]).reshape(t, h * self.v_dim)
        return self.o_proj(out), kv_cache

    def up_projection(self):
        """``kv_b_proj``'s kernel ``[kv_lora_rank, heads * (nope + v)]`` in float (int8 weights
        dequantized: the absorption multiplies it into queries and outputs)."""
        layer = self.kv_b_proj
        if type(layer) is nnx.Linear:
            return layer.kernel[...]
        if isinstance(layer, QuantizedLinear):
            return layer.kernel[...].astype(jnp.float32) * layer.scale[...]
        raise ValueError(f"quantization: kv_b_proj as {type(layer).__name__} is not supported by multi-head "
                         "latent attention (int8 or none)")

    def hf_weight_map(self, path: tuple, prefix: str, bias: bool):
        projs = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        projs += ["q_a_proj", "q_b_proj"] if self.q_lora_rank else ["q_proj"]
        out = [(path + (p, "kernel"), f"{prefix}{p}.weight", True) for p in projs]
        out += [(path + (p, "bias"), f"{prefix}{p}.bias", False)
                for p in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj") if bias and p in projs]
        norms = ["kv_a_layernorm"] + (["q_a_layernorm"] if self.q_lora_rank else [])
        return out + [(path + (n, "weight"), f"{prefix}{n}.weight", False) for n in norms]


class DeepseekMoE(SparseMoE):
    """`SparseMoE` with DeepSeek's router (`route`) and shared experts added to the routed ones."""

    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs, expert_parallel: bool):
        t = _text(c)
        super().__init__(c.hidden_size, t["moe_intermediate_size"], t["n_routed_experts"], t["num_experts_per_tok"],
                         normalize=bool(t.get("norm_topk_prob", False)), hidden_act=c.hidden_act, dtype=dtype,
                         rngs=rngs, expert_parallel=expert_parallel)
        self.method = _topk_method(c)
        self.num_groups, self.topk_group = t.get("n_group") or 1, t.get("topk_group") or 1
        self.scaling = float(t.get("routed_scaling_factor", 1.0))
        num_experts = t["n_routed_experts"]
        self.e_score_correction_bias = (nnx.Param(jnp.zeros((num_experts,), jnp.float32))
                                        if self.method == "noaux_tc" else None)
        shared = t.get("n_shared_experts") or 0
        self.shared_experts = (LlamaMLP(c, dtype, rngs, intermediate_size=t["moe_intermediate_size"] * shared)
                               if shared else None)

    def _group_mask(self, scores):
        """Keeps the experts of each token's best ``topk_group`` groups (True) [T, E]."""
        t, e = scores.shape
        grouped = scores.reshape(t, self.num_groups, e // self.num_groups)
        if self.method == "noaux_tc":
            group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)
        else:
            group_scores = jnp.max(grouped, axis=-1)
        _, best = lax.top_k(group_scores, self.topk_group)
        keep = jnp.zeros((t, self.num_groups), bool).at[jnp.arange(t)[:, None], best].set(True)
        return jnp.repeat(keep, e // self.num_groups, axis=1)

    def route(self, x):
        logits = jnp.dot(x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        if self.method == "noaux_tc":
            scores = jax.nn.sigmoid(logits)
            choice = scores + self.e_score_correction_bias[...]
            choice = jnp.where(self._group_mask(choice), choice, -jnp.inf)
            _, expert_ids = lax.top_k(choice, self.top_k)
            weights = jnp.take_along_axis(scores, expert_ids, axis=1)
            if self.normalize:
                weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        else:
            scores = jax.nn.softmax(logits, axis=-1)
            if self.method == "group_limited_greedy":
                scores = jnp.where(self._group_mask(scores), scores, 0.0)
            weights, expert_ids = lax.top_k(scores, self.top_k)
        return expert_ids, weights * self.scaling

    def __call__(self, x):
        routed = super().__call__(x)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


class DeepseekDecoderLayer(nnx.Module):
    def __init__(self, c: ModelConfig, dtype, backend: str, rngs: nnx.Rngs, mlp: nnx.Module):
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.self_attn = MLAAttention(c, dtype, backend, rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.mlp = mlp

    def __call__(self, x, cos, sin, kv_cache, md):
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V3: `LlamaForCausalLM`'s embedding, layer loop and head around
    `DeepseekDecoderLayer` (MLA + dense or `DeepseekMoE` MLP); ``expert_parallel``: whole experts
    per device."""

    HAS_EXPERTS = True
    # fields this family does not implement: (config.json field, the values it runs)
    UNSUPPORTED_FIELDS = {"mlp_bias": (None, False), "scoring_func": (None, "sigmoid", "softmax"),
                          "ep_size": (None, 1), "quantization_config": (None,)}

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs, expert_parallel: bool = False):
        c = self.config = config
        self.expert_parallel = expert_parallel
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DeepseekDecoderLayer(c, dtype, attention_backend, rngs, self.make_mlp(c, i, dtype, rngs))
                                for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, False, dtype, rngs)
        inv_freq, self.rope_factor, _ = rope_parameters(c)
        self.inv_freq = nnx.Variable(jnp.asarray(inv_freq))

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """A ValueError naming the config.json field of a variant this class does not implement."""
        super().check_config(config)
        t = _text(config)
        for name, allowed in cls.UNSUPPORTED_FIELDS.items():
            if t.get(name) not in allowed:
                raise ValueError(f"{name}={t.get(name)!r}: not supported by {cls.__name__} ({config.architecture})")
        scoring = t.get("scoring_func")
        expected = "sigmoid" if config.model_type == "deepseek_v3" else "softmax"
        if scoring not in (None, expected):
            raise ValueError(f"scoring_func={scoring!r}: {config.architecture} routes with {expected} scores")
        method = _topk_method(config)
        if method not in ROUTING[config.model_type]:
            raise ValueError(f"topk_method={method!r}: {config.architecture} runs {list(ROUTING[config.model_type])}")
        for name in ("qk_nope_head_dim", "v_head_dim", "n_routed_experts", "moe_intermediate_size",
                     "num_experts_per_tok"):
            value = t.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        latent_row_width(t)
        q_rank = t.get("q_lora_rank")
        if q_rank is not None and (isinstance(q_rank, bool) or not isinstance(q_rank, int) or q_rank < 1):
            raise ValueError(f"q_lora_rank={q_rank!r}: must be null or a positive integer")
        if t["qk_rope_head_dim"] % 2:
            raise ValueError(f"qk_rope_head_dim={t['qk_rope_head_dim']}: must be even (rope pairs)")
        rope = config.rope_scaling
        kind = None if rope is None else rope.get("rope_type", rope.get("type"))
        if kind not in (None,) + ROPE_TYPES:
            raise ValueError(f"rope_scaling={rope!r}: rope_type {kind!r} is not supported by {cls.__name__} "
                             f"(runs {list(ROPE_TYPES)})")
        if kind == "yarn" and not rope.get("factor") and not rope.get("original_max_position_embeddings"):
            raise ValueError(f"rope_scaling={rope!r}: yarn needs factor or original_max_position_embeddings")
        experts, k = t["n_routed_experts"], t["num_experts_per_tok"]
        groups, top_groups = t.get("n_group") or 1, t.get("topk_group") or 1
        if method != "greedy":
            if experts % groups:
                raise ValueError(f"n_group={groups}: does not divide n_routed_experts={experts}")
            if not 1 <= top_groups <= groups:
                raise ValueError(f"topk_group={top_groups}: must be in [1, n_group={groups}]")
            if k > top_groups * (experts // groups):
                raise ValueError(f"num_experts_per_tok={k}: more than the {top_groups * (experts // groups)} experts "
                                 f"of topk_group={top_groups} groups")
            if method == "noaux_tc" and experts // groups < 2:
                raise ValueError(f"n_group={groups}: noaux_tc ranks groups by their top 2 experts, "
                                 f"so each group needs 2 of the n_routed_experts={experts}")

    def is_sparse(self, layer: int) -> bool:
        return layer >= (_text(self.config).get("first_k_dense_replace") or 0)

    def make_mlp(self, c: ModelConfig, layer: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
        if not self.is_sparse(layer):
            return LlamaMLP(c, dtype, rngs)
        return DeepseekMoE(c, dtype, rngs, self.expert_parallel)

    def mlp_weight_map(self, layer: int, path: tuple, prefix: str):
        moe, p = path + ("mlp",), prefix + "mlp."
        if not self.is_sparse(layer):
            return LlamaMLP.hf_weight_map(moe, p)
        module = self.layers[layer].mlp
        out = [(moe + ("router",), p + "gate.weight", True)]
        if module.e_score_correction_bias is not None:
            out.append((moe + ("e_score_correction_bias",), p + "gate.e_score_correction_bias", False))
        for e in range(module.experts.gate_proj.shape[0]):
            out += [(moe + ("experts", proj, e), f"{p}experts.{e}.{proj}.weight", True)
                    for proj in ("gate_proj", "up_proj", "down_proj")]
        if module.shared_experts is not None:
            out += LlamaMLP.hf_weight_map(moe + ("shared_experts",), p + "shared_experts.")
        return out

    def init_buffers(self):
        self.inv_freq.set_value(jnp.asarray(rope_parameters(self.config)[0]))

    def embed_inputs(self, input_ids, positions):
        cos, sin = rope_cos_sin(self.inv_freq[...], positions)
        return self.embed_tokens(input_ids), (cos * self.rope_factor, sin * self.rope_factor)

    def hf_weight_map(self):
        c = self.config
        out = [(("embed_tokens", "embedding"), "model.embed_tokens.weight", False),
               (("norm", "weight"), "model.norm.weight", False)]
        if self.lm_head is not None:
            out.append((("lm_head", "kernel"), "lm_head.weight", True))
        for i in range(c.num_layers):
            p, L = f"model.layers.{i}.", ("layers", i)
            out += [(L + ("input_layernorm", "weight"), p + "input_layernorm.weight", False),
                    (L + ("post_attention_layernorm", "weight"), p + "post_attention_layernorm.weight", False)]
            out += self.layers[i].self_attn.hf_weight_map(L + ("self_attn",), p + "self_attn.", c.attention_bias)
            out += self.mlp_weight_map(i, L, p)
        return out
