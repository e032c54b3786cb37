"""The engine in an RL loop: new weights vs a new engine, and a GRPO-shaped rollout.

  python scripts/benchmark_rl.py                                   # SmolLM2-135M-shaped random model
  python scripts/benchmark_rl.py --num_prompts 16 --n 4 --max_tokens 32   # a quick look
  python scripts/benchmark_rl.py --rollout_engines jpaged,tunix    # once the Tunix side registers

Two random checkpoints of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads,
vocabulary 49152, tied embeddings; `bench_common.make_bench_model`, seeds 0 and 1) are written into
``--cache_dir``. Then, in one process (the JAX compilation cache in a fresh temporary directory):

  build cold     ``LLM(A)``: load, size the pool, compile the warm-up shapes (an empty cache)
  build warm     ``LLM(B)`` with the same settings: the compilation cache now holds every shape
  update path    ``llm.update_weights(B's directory)`` (read from disk, placed)
  update arrays  ``llm.update_weights({hf_name: jax.Array})``: a trainer's arrays on the device
                 (HF ``[out, in]`` kernels: transposed in the one jitted assembly); first call
                 (compiles the assembly) and a second one
  update state   ``llm.update_weights(nnx.State)`` of the engine's own model: a copy of its
                 float32 leaves (used as they are), and a bfloat16 copy (cast on the device)
  rollout        ``--num_prompts`` prompts x ``n`` samples, ``--max_tokens`` new tokens each,
                 temperature 1, ``ignore_eos``, ``logprobs=0``: generated tokens per second
  sleep          the bytes of JAX's live device arrays (each buffer once) (and the process's RSS) awake, after
                 ``sleep(1)``, after ``wake_up()``, after ``sleep(2)``, and the seconds each takes

``num_compilations`` is read before and after each update: it must not move. A rollout engine is a
function ``(llm, prompts, n, max_tokens) -> (generated tokens, seconds)`` in ``ROLLOUT_ENGINES``
(``llm``: the jpaged `LLM` holding the weights to roll out with); the Tunix vanilla rollout
registers its own there.
"""
import gc
import json
import os
import sys
import tempfile
import time

from absl import app, flags

F = flags.FLAGS
flags.DEFINE_integer("num_prompts", 64, "Prompts of the rollout batch")
flags.DEFINE_integer("n", 8, "Samples per prompt (GRPO's group size)")
flags.DEFINE_integer("max_tokens", 128, "New tokens per sample")
flags.DEFINE_integer("prompt_len", 64, "Token ids per prompt (random)")
flags.DEFINE_integer("max_num_seqs", 128, "Sequences that run at once")
flags.DEFINE_integer("kv_cache_memory_bytes", 2 << 30, "The KV pool's bytes")
flags.DEFINE_list("rollout_engines", ["jpaged"], "Rollout engines to time (ROLLOUT_ENGINES keys)")
flags.DEFINE_string("cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "jpaged"),
                    "Where the two random checkpoints are written (once)")

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048,
                     tie_word_embeddings=True, rope_theta=100000.0)


def engine_settings() -> dict:
    return dict(max_model_len=F.prompt_len + F.max_tokens + 16, max_num_seqs=F.max_num_seqs,
                kv_cache_memory_bytes=F.kv_cache_memory_bytes)


def checkpoints(cache_dir: str) -> tuple[str, str]:
    from bench_common import make_bench_model

    paths = []
    for seed in (0, 1):
        path = os.path.join(cache_dir, f"rl-smollm2-shape-seed{seed}")
        if not os.path.exists(os.path.join(path, "config.json")):
            make_bench_model(path, seed=seed, std=0.02, **SMOLLM2_SHAPE)
        paths.append(path)
    return paths[0], paths[1]


def prompts(num_prompts: int, length: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(3, SMOLLM2_SHAPE["vocab_size"], length).tolist() for _ in range(num_prompts)]


def jpaged_rollout(llm, batch, n: int, max_tokens: int) -> tuple[int, float]:
    from jpaged import SamplingParams

    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=0)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for o in outs for c in o.outputs), seconds


ROLLOUT_ENGINES = {"jpaged": jpaged_rollout}  # name -> (llm, prompts, n, max_tokens) -> (tokens, seconds)


def device_memory() -> dict:
    import jax

    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    buffers = {s.data.unsafe_buffer_pointer(): s.data.nbytes for x in jax.live_arrays() for s in x.addressable_shards}
    return {"live_array_mib": round(sum(buffers.values()) / 2**20, 1),
            "rss_mib": round(rss / 2**20, 1)}


def sleep_figures(llm, path: str) -> dict:
    out = {"awake": device_memory()}
    _, out["sleep1_s"] = timed(lambda: llm.sleep(1))
    out["asleep_level1"] = device_memory()
    _, out["wake_up_s"] = timed(llm.wake_up)
    out["woken"] = device_memory()
    llm.sleep(2)
    out["asleep_level2"] = device_memory()
    llm.update_weights(path)
    llm.wake_up()
    return out


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main(argv):
    del argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jpaged-rl-jax-"))
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    from jpaged import LLM
    from jpaged.loading.weight_update import read_named_weights

    path_a, path_b = checkpoints(F.cache_dir)
    results = {"settings": dict(num_prompts=F.num_prompts, n=F.n, max_tokens=F.max_tokens, prompt_len=F.prompt_len,
                                **engine_settings())}
    llm, results["build_cold_s"] = timed(lambda: LLM(path_a, **engine_settings()))
    other, results["build_warm_s"] = timed(lambda: LLM(path_b, **engine_settings()))
    del other
    gc.collect()  # its buffers (NNX modules are reference cycles) before anything is measured
    compilations = llm.get_metrics()["num_compilations"]
    def placed() -> None:  # the transfers done (returns nothing: a kept result would hold the weights)
        jax.block_until_ready(llm.llm_engine.runner.state)

    _, results["update_path_s"] = timed(lambda: (llm.update_weights(path_b), placed()))
    arrays = {k: jax.device_put(v) for k, v in read_named_weights(path_a).items() if k != "lm_head.weight"}
    jax.block_until_ready(arrays)
    _, results["update_arrays_first_s"] = timed(lambda: (llm.update_weights(arrays), placed()))
    _, results["update_arrays_s"] = timed(lambda: (llm.update_weights(arrays), placed()))
    arrays = None  # released before the next form
    state = jax.tree.map(lambda x: x.copy(), llm.llm_engine.runner.state)
    _, results["update_state_same_dtype_s"] = timed(lambda: (llm.update_weights(state), placed()))
    state = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, state)
    _, results["update_state_bf16_first_s"] = timed(lambda: (llm.update_weights(state), placed()))
    _, results["update_state_bf16_s"] = timed(lambda: (llm.update_weights(state), placed()))
    state = None
    results["compilations_added_by_updates"] = llm.get_metrics()["num_compilations"] - compilations
    results["update_arrays_vs_build_warm"] = results["update_arrays_s"] / results["build_warm_s"]
    results["update_path_vs_build_warm"] = results["update_path_s"] / results["build_warm_s"]
    results["update_state_vs_build_warm"] = results["update_state_same_dtype_s"] / results["build_warm_s"]
    print("updates:", json.dumps(results), flush=True)  # before the long rollout
    batch = prompts(F.num_prompts, F.prompt_len)
    for name in F.rollout_engines:
        tokens, seconds = ROLLOUT_ENGINES[name](llm, batch, F.n, F.max_tokens)
        results[f"rollout_{name}"] = dict(tokens=tokens, seconds=round(seconds, 2), tok_per_s=round(tokens / seconds, 1))
    compilations = llm.get_metrics()["num_compilations"]
    results["sleep"] = sleep_figures(llm, path_a)
    results["compilations_added_by_sleep"] = llm.get_metrics()["num_compilations"] - compilations
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    app.run(main)
