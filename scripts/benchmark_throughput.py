"""Offline throughput under one KV memory budget: paged against the Orca reservation baselines.

  python scripts/benchmark_throughput.py --allocator paged,oracle,max --num_kv_blocks 256
  python scripts/benchmark_throughput.py --workload alpaca-like --num_requests 200 --allocator pow2
  python scripts/benchmark_throughput.py --model path/to/hf_dir --num_kv_blocks 512 --length_scale 0.5

Every allocator runs the real engine (same model, kernels and scheduler; only the KV cache
manager differs) on the same requests from ``../shared/peers/workloads.py``, all queued at once,
greedy with ``ignore_eos`` so that each request produces exactly its workload output length (what
the ``oracle`` allocator knows). Without ``--model`` the shared ``bench-llama`` checkpoint is built
once into ``--cache_dir`` with transformers (as peers/make_bench_model.py does).

Prints per allocator: requests/s, total and output tokens/s, mean batch size (requests advanced per
engine step; also over the steps during which some request was still waiting, i.e. when the memory
budget, not the queue, limits the batch), preemptions, engine steps and compilations; then paged's ratios over each baseline. Time spent
compiling new shapes (JAX's compile events) is subtracted, so the first allocator of a run is not
penalized for compiling what the others then reuse.
``--length_scale`` shrinks every prompt and output length (the shape of the distribution is kept),
so that a CPU finishes in minutes; set ``--max_model_len`` to match (it is what ``max`` reserves).
"""
import os
import sys
import time

import jax
from absl import app, flags

from jpaged import LLM, SamplingParams

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOCATORS = ("paged", "max", "pow2", "oracle")

F = flags.FLAGS
flags.DEFINE_string("model", None, "HF checkpoint directory; default: bench-llama, built into --cache_dir")
flags.DEFINE_string("cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "jpaged"),
                    "Where bench-llama is built")
flags.DEFINE_string("peers_dir", os.path.join(REPO_ROOT, "..", "shared", "peers"), "Where workloads.py is")
flags.DEFINE_enum("workload", "sharegpt-like", ["sharegpt-like", "alpaca-like", "fixed"], "Shared workload")
flags.DEFINE_integer("num_requests", 64, "Requests drawn from the workload")
flags.DEFINE_float("length_scale", 1.0, "Multiplies every prompt and output length (>= 1 token each)")
flags.DEFINE_integer("seed", 0, "Workload seed")
flags.DEFINE_list("allocator", ["paged"], "paged | max | pow2 | oracle; a comma list runs each in turn")
flags.DEFINE_integer("num_kv_blocks", None, "KV pool size in blocks, the same for every allocator")
flags.DEFINE_integer("block_size", 16, "Tokens per KV block")
flags.DEFINE_integer("max_model_len", 2048, "Longest prompt + output (what `max` reserves)")
flags.DEFINE_integer("max_num_seqs", 256, "Sequences per step")
flags.DEFINE_integer("max_num_batched_tokens", 2048, "Tokens per step")
flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16", "float16"], "Weights and KV cache dtype")


# Set-up helpers (also used by benchmark_serving.py) ------------------------------------------------------
def bench_model_dir(cache_dir: str) -> str:
    """The shared random ``bench-llama`` checkpoint, built once (the config of make_bench_model.py)."""
    path = os.path.join(cache_dir, "bench-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)
        LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def load_workload(peers_dir: str, name: str, vocab_size: int, num_requests=None, seed: int = 0,
                  length_scale: float = 1.0):
    """(prompts, output_lens) from the shared ``workloads.py``, lengths scaled by ``length_scale``."""
    sys.path.insert(0, os.path.abspath(peers_dir))
    try:
        from workloads import make_workload
    finally:
        sys.path.pop(0)
    prompts, output_lens = make_workload(name, vocab_size, num_requests, seed)
    if length_scale != 1.0:
        prompts = [p[:max(1, round(len(p) * length_scale))] for p in prompts]
        output_lens = [max(1, round(n * length_scale)) for n in output_lens]
    return prompts, output_lens


def engine_kwargs(allocator: str) -> dict:
    """LLM(...) settings for one run (add parallelism flags here)."""
    kwargs = dict(allocator=allocator, block_size=F.block_size, max_model_len=F.max_model_len,
                  max_num_seqs=F.max_num_seqs, max_num_batched_tokens=F.max_num_batched_tokens, dtype=F.dtype,
                  enable_prefix_caching=False)
    if F.num_kv_blocks is not None:
        kwargs["num_kv_blocks"] = F.num_kv_blocks
    return kwargs


def make_requests(prompts, output_lens) -> list[tuple[list[int], SamplingParams]]:
    """(prompt token ids, sampling params) per request (add --n / --shared_prefix here)."""
    return [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, output_lens)]


# The benchmark ------------------------------------------------------------------------------------------
COMPILE_SECONDS = [0.0]  # tracing, lowering and compiling (or loading from the persistent cache)


def _count_compile_time(event: str, duration: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
        COMPILE_SECONDS[0] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile_time)


# ------------------------------------------------------------------------------------------
def run(llm: LLM, requests) -> dict:
    """Queues every request, steps the engine until all finish; throughput and batch statistics."""
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    steps = batched = loaded_steps = loaded_batched = 0
    finished = []
    compile_start = COMPILE_SECONDS[0]
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        batched += len(outputs)  # requests that advanced this step
        if engine.scheduler.waiting:  # under memory pressure: some request could not be admitted
            loaded_steps += 1
            loaded_batched += len(outputs)
        finished += [o for o in outputs if o.finished]
    compiling = COMPILE_SECONDS[0] - compile_start
    elapsed = time.perf_counter() - start - compiling  # new shapes compile once; not throughput
    out_tokens = sum(len(c.token_ids) for o in finished for c in o.outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in finished)
    metrics = llm.get_metrics()
    return {"requests/s": len(finished) / elapsed, "tokens/s": (in_tokens + out_tokens) / elapsed,
            "output tokens/s": out_tokens / elapsed, "mean batch": batched / max(steps, 1),
            "loaded batch": loaded_batched / max(loaded_steps, 1),
            "preemptions": metrics["num_preemptions"], "steps": steps, "seconds": elapsed,
            "compile seconds": compiling,
            "compilations": metrics["num_compilations"], "blocks": metrics["num_total_blocks"]}


def main(argv):
    del argv
    for a in F.allocator:
        if a not in ALLOCATORS:
            raise app.UsageError(f"--allocator: {a!r} is not one of {ALLOCATORS}")
    model = F.model or bench_model_dir(F.cache_dir)
    results = {}
    for allocator in F.allocator:
        llm = LLM(model, **engine_kwargs(allocator))
        vocab = llm.llm_engine.model_config.vocab_size
        prompts, output_lens = load_workload(F.peers_dir, F.workload, vocab, F.num_requests, F.seed, F.length_scale)
        r = results[allocator] = run(llm, make_requests(prompts, output_lens))
        print(f"{allocator:<7} {r['requests/s']:.3f} requests/s  {r['tokens/s']:.1f} tokens/s  "
              f"({r['output tokens/s']:.1f} output)  mean batch {r['mean batch']:.2f} "
              f"({r['loaded batch']:.2f} while requests wait)  "
              f"preemptions {r['preemptions']}  steps {r['steps']}  {r['seconds']:.1f} s "
              f"(+{r['compile seconds']:.1f} s compiling, not counted)  "
              f"[{F.workload}, {len(prompts)} requests, {r['blocks']} blocks x {F.block_size}, "
              f"{r['compilations']} compilations]", flush=True)
        del llm
    if "paged" in results:
        p = results["paged"]
        for name, r in results.items():
            if name != "paged":
                print(f"paged / {name:<6}  throughput {p['requests/s'] / r['requests/s']:.2f}x  "
                      f"mean batch {p['mean batch'] / r['mean batch']:.2f}x "
                      f"({p['loaded batch'] / r['loaded batch']:.2f}x while requests wait)")


if __name__ == "__main__":
    app.run(main)
