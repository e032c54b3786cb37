"""Multi-head latent attention decode on this CPU: one DeepSeek attention layer's decode step over
the latent pool (absorbed up-projections, `pallas_kernels.paged_mla`, what `DeepseekForCausalLM`
runs) against the same layer with per-head K and V expanded from the same latents into an
ordinary paged pool (the engine's CPU attention path for a multi-head model, `xla_paged_attention`).

  python scripts/benchmark_mla.py                          # DeepSeek-V2-Lite's attention, 1k and 8k context
  python scripts/benchmark_mla.py --contexts 1024,8192,32768 --batch 1
  python scripts/benchmark_mla.py --heads 128 --batch 1    # V3's 128 heads

Both variants take the same weights and latents; the step includes the query absorption
(``q_nope @ W_UK``) and the value up-projection for MLA, and reads ``[K | V]`` pages of
``qk_nope + qk_rope`` values per head for the expanded one (V zero-padded to that width, as the
paged kernels take one head size; the byte column counts the unpadded K and V). Printed per
context: KV bytes per token and layer, the step time (least of ``--runs`` after a warm-up,
compile time not counted), decode tokens/s of a model of ``--layers`` such layers counting
attention only, and the largest difference between the two outputs. Then KV bytes per token of
whole models: DeepSeek-V3 latent vs expanded vs a GQA model of similar size. Not a timed test: run
it on a quiet machine (the load average is printed before and after).
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench_common import describe_machine
from jpaged.models.attention import make_attention_metadata, xla_paged_attention
from pallas_kernels import paged_mla

flags.DEFINE_list("contexts", ["1024", "8192"], "Context lengths to time")
flags.DEFINE_integer("batch", 2, "Sequences decoding at once")
flags.DEFINE_integer("heads", 16, "Attention heads")
flags.DEFINE_integer("kv_lora_rank", 512, "Latent width")
flags.DEFINE_integer("rope_dim", 64, "qk_rope_head_dim")
flags.DEFINE_integer("nope_dim", 128, "qk_nope_head_dim")
flags.DEFINE_integer("v_dim", 128, "v_head_dim")
flags.DEFINE_integer("layers", 27, "Layers of the model the tokens/s column stands for (V2-Lite: 27)")
flags.DEFINE_integer("block_size", 16, "Tokens per KV block")
flags.DEFINE_integer("runs", 5, "Timed runs per case (the least counts)")
F = flags.FLAGS

# (name, layers, values cached per token and layer) of whole models, for the bytes table
MODELS = [("DeepSeek-V3 671B, MLA latent (576 values)", 61, 512 + 64),
          ("DeepSeek-V3 671B, K/V expanded (128 heads x (192 + 128))", 61, 128 * (192 + 128)),
          ("Llama-3.1-405B, GQA (8 KV heads x 128, K and V)", 126, 2 * 8 * 128),
          ("Llama-3.1-70B, GQA (8 KV heads x 128, K and V)", 80, 2 * 8 * 128)]


def best_time(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(F.runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def pools(rng, context: int):
    """Latent rows of ``batch`` sequences of ``context`` tokens in consecutive blocks, the up-projection
    weights, and the pools: latent halves ``[1, N, bs, W/2]`` and expanded K/V ``[H, N, bs, qk]``."""
    b, h, r, p, n, v = F.batch, F.heads, F.kv_lora_rank, F.rope_dim, F.nope_dim, F.v_dim
    bs = F.block_size
    blocks_per_seq = -(-context // bs)
    num_blocks = b * blocks_per_seq
    tokens = num_blocks * bs
    c_kv = jnp.asarray(rng.standard_normal((tokens, r), np.float32))
    k_pe = jnp.asarray(rng.standard_normal((tokens, p), np.float32))
    w_uk = jnp.asarray(rng.standard_normal((r, h, n), np.float32) * r ** -0.5)
    w_uv = jnp.asarray(rng.standard_normal((r, h, v), np.float32) * r ** -0.5)
    latent = jnp.concatenate([c_kv, k_pe], axis=-1).reshape(num_blocks, bs, r + p)
    half = (r + p) // 2
    latent_k, latent_v = latent[None, ..., :half], latent[None, ..., half:]

    @jax.jit
    def expand(c_kv, k_pe):
        k = jnp.concatenate([jnp.einsum("tr,rhn->htn", c_kv, w_uk),
                             jnp.broadcast_to(k_pe[None], (h,) + k_pe.shape)], axis=-1)
        values = jnp.einsum("tr,rhv->htv", c_kv, w_uv)
        values = jnp.pad(values, ((0, 0), (0, 0), (0, n + p - v)))
        return k.reshape(h, num_blocks, bs, n + p), values.reshape(h, num_blocks, bs, n + p)

    k_pages, v_pages = expand(c_kv, k_pe)
    tables = np.arange(num_blocks, dtype=np.int32).reshape(b, blocks_per_seq)
    return (latent_k, latent_v), (k_pages, v_pages), w_uk, w_uv, tables


def main(argv):
    del argv
    describe_machine()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    b, h, r, p, n, v = F.batch, F.heads, F.kv_lora_rank, F.rope_dim, F.nope_dim, F.v_dim
    scale = (n + p) ** -0.5
    latent_bytes, expanded_bytes = 4 * (r + p), 4 * h * (n + p + v)
    print(f"one layer: {h} heads, kv_lora_rank {r}, rope {p}, nope {n}, v {v}; batch {b}; float32")
    print(f"{'context':>7} {'variant':>9} {'KV B/token':>11} {'step ms':>8} {'tok/s':>8} {'max |diff|':>11}")

    @jax.jit
    def mla_step(q_nope, q_pe, w_uk, w_uv, k_pages, v_pages, tables, seq_lens):
        q = jnp.concatenate([jnp.einsum("bhn,rhn->bhr", q_nope, w_uk), q_pe], axis=-1)
        out = paged_mla.mla_paged_attention_reference(q, k_pages, v_pages, tables, seq_lens,
                                                      jnp.arange(b + 1, dtype=jnp.int32), b, kv_lora_rank=r,
                                                      scale=scale)
        return jnp.einsum("bhr,rhv->bhv", out, w_uv)

    @jax.jit
    def expanded_step(q_nope, q_pe, k_pages, v_pages, md):
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        return xla_paged_attention(q, k_pages, v_pages, md, scale=scale)[..., :v]

    for context in map(int, F.contexts):
        latent, expanded, w_uk, w_uv, tables = pools(rng, context)
        seq_lens = np.full((b,), context, np.int32)
        md = make_attention_metadata("xla", positions=seq_lens - 1, slot_mapping=np.full((b,), -1, np.int32),
                                     query_start_loc=np.arange(b + 1), seq_lens=seq_lens, block_tables=tables,
                                     num_seqs=b)
        q_nope = jnp.asarray(rng.standard_normal((b, h, n), np.float32))
        q_pe = jnp.asarray(rng.standard_normal((b, h, p), np.float32))
        mla_args = (q_nope, q_pe, w_uk, w_uv, *latent, tables, seq_lens)
        exp_args = (q_nope, q_pe, *expanded, md)
        t_mla, t_exp = best_time(mla_step, *mla_args), best_time(expanded_step, *exp_args)
        diff = float(jnp.max(jnp.abs(mla_step(*mla_args) - expanded_step(*exp_args))))
        for name, t, nbytes in (("mla", t_mla, latent_bytes), ("expanded", t_exp, expanded_bytes)):
            print(f"{context:>7} {name:>9} {nbytes:>11} {t * 1e3:>8.2f} {b / (t * F.layers):>8.1f} "
                  f"{diff if name == 'mla' else float('nan'):>11.2e}")
        print(f"{context:>7} {'ratio':>9} {expanded_bytes / latent_bytes:>10.1f}x {t_exp / t_mla:>7.2f}x")
        del latent, expanded
    print("\nKV bytes per token, whole model, bfloat16:")
    for name, layers, values in MODELS:
        print(f"  {name:<58} {layers * values * 2:>11,}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
