"""Rollout throughput in Tunix: `JpagedRollout` vs Tunix's vanilla rollout on the same model.

Runs in the Tunix venv (``bash scripts/setup_tunix.sh``)::

  ~/.cache/jpaged/tunix/bin/python scripts/benchmark_tunix_rollout.py               # 64 x 8, 128 tokens
  ~/.cache/jpaged/tunix/bin/python scripts/benchmark_tunix_rollout.py --num_prompts 8 --n 4 --max_tokens 32

A random Tunix ``Llama3`` of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads,
head_dim 64, MLP 1536, vocabulary 49152, tied embeddings), a GRPO-shaped batch: ``--num_prompts``
prompts of ``--prompt_len`` bytes, each repeated ``n`` times (as Tunix's GRPO learner passes them),
``--max_tokens`` new tokens, temperature 1, top_p 1, one stop token both engines share. Each engine
generates the batch once to compile and once timed; the figure is generated tokens per second of
the timed call (``RolloutOutput.tokens``). Prints one ``BENCH {json}`` line.
"""
import dataclasses
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

F = flags.FLAGS
flags.DEFINE_integer("num_prompts", 64, "Distinct prompts of the batch")
flags.DEFINE_integer("n", 8, "Samples per prompt (GRPO's num_generations)")
flags.DEFINE_integer("max_tokens", 128, "New tokens per sample")
flags.DEFINE_integer("prompt_len", 64, "Bytes per prompt")
flags.DEFINE_list("engines", ["jpaged", "vanilla"], "Rollout engines to time")
flags.DEFINE_integer("max_num_seqs", 512, "jpaged: sequences that run at once")
flags.DEFINE_integer("num_kv_blocks", 2048, "jpaged: KV pool blocks (of --block_size tokens)")
flags.DEFINE_integer("block_size", 16, "jpaged: tokens per KV block")


def smollm2_shaped_llama3(seed: int = 0):
    import jax
    from flax import nnx
    from tunix.models.llama3 import model as llama3

    config = llama3.ModelConfig(num_layers=30, vocab_size=49152, embed_dim=576, hidden_dim=1536, num_heads=9,
                                head_dim=64, num_kv_heads=3, rope_theta=10_000, norm_eps=1e-5, weight_tying=True)
    model = llama3.Llama3(config, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        noise = jax.random.normal(jax.random.fold_in(key, i), var.shape, var.dtype)
        var.set_value(1.0 + 0.05 * noise if path[-2].endswith("norm") else 0.05 * noise)
    return model


def rollouts(model, tokenizer, rollout_config):
    from tunix.generate import tokenizer_adapter
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    from jpaged.integrations.tunix import JpagedRollout

    adapter = tokenizer_adapter.TokenizerAdapter(tokenizer)
    c = model.config
    makers = {
        "jpaged": lambda: JpagedRollout(model, adapter, None, rollout_config, max_num_seqs=F.max_num_seqs,
                                        num_kv_blocks=F.num_kv_blocks, block_size=F.block_size),
        "vanilla": lambda: vanilla_rollout.VanillaRollout(model, adapter, base_rollout.CacheConfig(
            cache_size=rollout_config.kv_cache_size, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim)),
    }
    unknown = sorted(set(F.engines) - set(makers))
    if unknown:
        raise ValueError(f"--engines: unknown {unknown} (known: {sorted(makers)})")
    return {name: makers[name] for name in F.engines}


def main(argv):
    del argv
    import numpy as np
    from tunix.rl.rollout import base_rollout

    from conftest import byte_tokenizer

    rng = np.random.default_rng(0)
    prompts = ["".join(chr(c) for c in rng.integers(97, 123, F.prompt_len)) for _ in range(F.num_prompts)]
    batch = [p for p in prompts for _ in range(F.n)]
    prompt_width = 1 << (F.prompt_len + 1 - 1).bit_length()  # bos + bytes, padded to a power of two
    config = base_rollout.RolloutConfig(max_tokens_to_generate=F.max_tokens, max_prompt_length=prompt_width,
                                        temperature=1.0, top_p=1.0, seed=0, eos_tokens=[49151],
                                        kv_cache_size=prompt_width + F.max_tokens)
    model = smollm2_shaped_llama3()
    result = {"num_prompts": F.num_prompts, "n": F.n, "max_tokens": F.max_tokens, "prompt_len": F.prompt_len}
    for name, make in rollouts(model, byte_tokenizer(), config).items():
        start = time.perf_counter()
        rollout = make()
        rollout.generate(batch, dataclasses.replace(config, seed=1))  # compiles
        warm = time.perf_counter() - start
        start = time.perf_counter()
        out = rollout.generate(batch, config)
        seconds = time.perf_counter() - start
        tokens = sum(len(t) for t in out.tokens)
        result[name] = {"tokens": tokens, "seconds": round(seconds, 2), "tok_per_s": round(tokens / seconds, 1),
                        "build_and_first_call_s": round(warm, 1)}
        print(f"{name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s "
              f"(build + first call {warm:.1f} s)", flush=True)
        del rollout
    if "jpaged" in result and "vanilla" in result:
        result["speedup"] = round(result["jpaged"]["tok_per_s"] / result["vanilla"]["tok_per_s"], 2)
    print("BENCH " + json.dumps(result), flush=True)


if __name__ == "__main__":
    app.run(main)
