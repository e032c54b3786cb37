"""A custom NNX decoder served by jpaged through the paged KV cache.

`SquaredReluLM` is a Llama variant written from scratch with jpaged's building blocks:

- its own attention module (one fused QKV projection, rotary embeddings from `jpaged.models.llama`)
  that calls `jpaged.models.attention.PagedAttention` with the engine's `AttentionMetadata`;
- a different MLP: squared ReLU (Primer, So et al. 2021) instead of SwiGLU;
- its own names for everything (``blocks``, ``attention``, ``embed``...), and optional tied embeddings.

A model is served by the engine when it has:

- ``config``: a `jpaged.models.ModelConfig` (the engine reads num_layers, num_kv_heads, head_dim,
  vocab_size, max_position_embeddings and eos_token_ids from it to size the KV pool);
- ``__call__(input_ids[T], positions[T], kv_caches, md) -> (hidden[T, H], kv_caches)``: one flat
  token batch of the step (prompt chunks and decode tokens of many sequences together),
  ``kv_caches`` one ``(k_pages, v_pages)`` per layer, ``md`` the step's `AttentionMetadata`;
- ``compute_logits(hidden[S, H]) -> [S, vocab]`` float32;
- the constructor ``__init__(config, *, dtype, attention_backend, rngs)`` (to restore it from an
  orbax checkpoint).

The same model also runs densely (no cache) through `jpaged.models.training`, which is what this
script compares against: the paged engine and a plain full-sequence forward must pick the same
greedy tokens.

Run: ``python examples/custom_model.py``
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged import LLM, SamplingParams
from jpaged.models.attention import AttentionMetadata, PagedAttention
from jpaged.models import ModelConfig
from jpaged.models.layers import RMSNorm, apply_rope, rope_inv_freq
from jpaged.models.training import greedy_generate


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(architecture="SquaredReluLM", model_type="squared_relu_lm", vocab_size=256,
                  hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=512, intermediate_size=192, norm_eps=1e-6,
                  tie_word_embeddings=False, eos_token_ids=(2,))
    return ModelConfig(**{**fields, **overrides})


class FusedQKVAttention(nnx.Module):
    def __init__(self, c: ModelConfig, dtype, attention_backend: str, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.qkv = nnx.Linear(c.hidden_size, width, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(c.num_heads * c.head_dim, c.hidden_size, use_bias=False, dtype=dtype,
                              param_dtype=dtype, rngs=rngs)
        # The building block: writes this step's K/V into the pool, attends through the block tables.
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.head_dim, backend=attention_backend)

    def __call__(self, x, cos, sin, kv_cache, md: AttentionMetadata):
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = jnp.split(self.qkv(x), [hq * d, (hq + hkv) * d], axis=-1)
        q = apply_rope(q.reshape(t, hq, d), cos, sin)
        k = apply_rope(k.reshape(t, hkv, d), cos, sin)
        out, kv_cache = self.attn(q, k, v.reshape(t, hkv, d), kv_cache, md)
        return self.out(out.reshape(t, hq * d)), kv_cache


class SquaredReluMLP(nnx.Module):
    def __init__(self, c: ModelConfig, dtype, rngs: nnx.Rngs):
        self.up = nnx.Linear(c.hidden_size, c.intermediate_size, use_bias=False, dtype=dtype,
                             param_dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(c.intermediate_size, c.hidden_size, use_bias=False, dtype=dtype,
                               param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.square(jax.nn.relu(self.up(x))))


class Block(nnx.Module):
    def __init__(self, c: ModelConfig, dtype, attention_backend: str, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.attention = FusedQKVAttention(c, dtype, attention_backend, rngs)
        self.mlp_norm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.mlp = SquaredReluMLP(c, dtype, rngs)

    def __call__(self, x, cos, sin, kv_cache, md):
        h, kv_cache = self.attention(self.attn_norm(x), cos, sin, kv_cache, md)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), kv_cache


class SquaredReluLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs):
        c = self.config = config
        self.embed = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(c, dtype, attention_backend, rngs) for _ in range(c.num_layers)])
        self.final_norm = RMSNorm(c.hidden_size, c.norm_eps, dtype)
        self.unembed = None if c.tie_word_embeddings else nnx.Linear(
            c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(c)))

    def init_buffers(self):
        self.inv_freq.set_value(jnp.asarray(rope_inv_freq(self.config)))

    def __call__(self, input_ids, positions, kv_caches, md):
        x = self.embed(input_ids)
        freqs = positions.astype(jnp.float32)[:, None] * self.inv_freq[...][None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        new_caches = []
        for block, kv_cache in zip(self.blocks, kv_caches):
            x, kv_cache = block(x, cos, sin, kv_cache, md)
            new_caches.append(kv_cache)
        return self.final_norm(x), new_caches

    def compute_logits(self, hidden):
        logits = self.embed.attend(hidden) if self.unembed is None else self.unembed(hidden)
        return logits.astype(jnp.float32)


def build_model(seed: int = 0, **config_overrides) -> SquaredReluLM:
    return SquaredReluLM(tiny_config(**config_overrides), rngs=nnx.Rngs(seed))


def main(num_prompts: int = 3, max_tokens: int = 16) -> list[tuple[list[int], list[int]]]:
    """Generates through the paged cache and checks each output against a no-cache greedy run."""
    model = build_model()
    llm = LLM.from_model(model, block_size=8, num_kv_blocks=64, max_model_len=256)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 21, 40)[:num_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        paged = out.outputs[0].token_ids
        dense = greedy_generate(model, prompt, max_tokens)
        print(f"prompt of {len(prompt):2d} tokens  paged {paged}\n{'':20s}dense {dense}")
        assert paged == dense, "the paged engine and the dense forward disagree"
        results.append((paged, dense))
    print("paged-cache generation matches the no-cache forward token for token")
    return results


if __name__ == "__main__":
    main()
