"""Offline throughput under one KV memory budget: paged against the Orca reservation baselines.

  python scripts/benchmark_throughput.py --allocator paged,oracle,max --num_kv_blocks 256
  python scripts/benchmark_throughput.py --workload alpaca-like --num_requests 200 --allocator pow2
  python scripts/benchmark_throughput.py --model path/to/hf_dir --num_kv_blocks 512 --length_scale 0.5
  python scripts/benchmark_throughput.py --model smollm2 --workload fixed --num_requests 32
  python scripts/benchmark_throughput.py --kv_cache_dtype auto,int8 --kv_cache_memory_bytes 8388608

Every allocator runs the real engine (same model, kernels and scheduler; only the KV cache
manager differs) on the same requests from ``scripts/workloads.py``, all queued at once,
greedy with ``ignore_eos`` so that each request produces exactly its workload output length (what
the ``oracle`` allocator knows). Without ``--model`` the random ``bench-llama`` checkpoint is built
once into ``--cache_dir`` (``bench_common.make_bench_model``); ``--model smollm2`` is the embedded
SmolLM2-135M-Instruct as a float32 Hugging Face directory (``bench_common.smollm2_dir``).

First it prints the machine (CPU model, AVX-512 or AVX2, cores, load), its float32 GEMM peak and
its memory bandwidth (`bench_common.memory_bandwidth_gbs`), measured then; every throughput line
then gives the matmul GFLOP/s it implies and their fraction of that peak, and a roofline: the
longer of the matmuls at the GEMM peak and the run's memory floor (each model step reads every
weight; each generated token reads the KV cache of its context: `bench_common.memory_floor_bytes`)
at that bandwidth, an estimate, with its share of the run's time. So each figure says what machine
it comes from and how near the machine's limit it is.

Prints per allocator: requests/s, total and output tokens/s, mean batch size (requests advanced per
engine step; also over the steps during which some request was still waiting, i.e. when the memory
budget, not the queue, limits the batch), preemptions, engine steps and compilations; then paged's ratios over each baseline. Time spent
compiling new shapes (JAX's compile events) is subtracted, so the first allocator of a run is not
penalized for compiling what the others then reuse.
``--kv_cache_dtype auto,int8`` runs each KV cache dtype in turn; give the pool as a byte budget
(``--kv_cache_memory_bytes``) so that 8-bit pages get the extra blocks the same memory holds.
``--length_scale`` shrinks every prompt and output length (the shape of the distribution is kept),
so that a CPU finishes in minutes; set ``--max_model_len`` to match (it is what ``max`` reserves).
"""
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench_common import (CACHE_DIR, COMPILE_SECONDS, describe_machine, matmul_flops, matmul_weights, memory_bandwidth_gbs,
                          memory_floor_bytes, model_dir, roofline_seconds)
from workloads import make_workload
from jpaged import LLM, BeamSearchParams, SamplingParams
from jpaged.engine.step_timing import StepTimings

ALLOCATORS = ("paged", "max", "pow2", "oracle")

F = flags.FLAGS
flags.DEFINE_string("model", "bench-llama", "HF checkpoint directory, or bench-llama / smollm2 (built into --cache_dir)")
flags.DEFINE_string("cache_dir", CACHE_DIR, "Where bench-llama and smollm2 are built")
flags.DEFINE_enum("workload", "sharegpt-like", ["sharegpt-like", "alpaca-like", "fixed"], "Workload (scripts/workloads.py)")
flags.DEFINE_integer("num_requests", 64, "Requests drawn from the workload")
flags.DEFINE_float("length_scale", 1.0, "Multiplies every prompt and output length (>= 1 token each)")
flags.DEFINE_integer("seed", 0, "Workload seed")
flags.DEFINE_list("allocator", ["paged"], "paged | max | pow2 | oracle; a comma list runs each in turn")
flags.DEFINE_integer("num_kv_blocks", None, "KV pool size in blocks, the same for every allocator")
flags.DEFINE_integer("kv_cache_memory_bytes", None, "KV pool size in bytes (blocks follow the KV dtype)")
flags.DEFINE_list("kv_cache_dtype", ["auto"], "auto | int8 | fp8; a comma list runs each in turn")
flags.DEFINE_integer("block_size", 16, "Tokens per KV block")
flags.DEFINE_integer("max_model_len", 2048, "Longest prompt + output (what `max` reserves)")
flags.DEFINE_integer("max_num_seqs", 256, "Sequences per step")
flags.DEFINE_integer("max_num_batched_tokens", 2048, "Tokens per step")
flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16", "float16"], "Weights and KV cache dtype")
# Sharing (the paper's section 4.4 / 6.3-6.4): each runs with sharing on and off
flags.DEFINE_integer("n", 1, "Parallel samples per request (sharing off: n separate requests)")
flags.DEFINE_integer("beam_width", 0, "Beam search width (0: no beam search; sharing off: forks copy blocks)")
flags.DEFINE_enum("shared_prefix", "none", ["none", "1-shot", "5-shot"],
                  "Prepend one common prefix (~80 or ~340 tokens) to every prompt (sharing: prefix caching)")
flags.DEFINE_enum("sharing", "on", ["on", "off", "both"], "Block sharing for --n / --beam_width / --shared_prefix")
# Parallelism
flags.DEFINE_integer("tensor_parallel_size", 1, "Devices per replica (attention heads split)")
flags.DEFINE_integer("data_parallel_size", 1, "Engine replicas")
# Where the time goes
flags.DEFINE_integer("num_scheduler_steps", None, "Decode steps per host round trip (decode windows; unset: the engine's default, 8 on the CPU)")
flags.DEFINE_bool("cpu_packed_weights", True, "On the CPU, packed copies of the projections for the C++ matmul "
                  "(the engine's default; --nocpu_packed_weights: the weights as they lie)")
flags.DEFINE_bool("precompile", True, "Compile every step shape before the timed run (start-up time is printed)")
flags.DEFINE_integer("single_stream", 0, "Then also time one request alone (32 prompt tokens) of this many output tokens")
flags.DEFINE_bool("profile", False, "Print the per-step breakdown (schedule, prepare, device, post-process) "
                  "and the time by kind of step (prompt; decode by rows)")
flags.DEFINE_string("trace_dir", None, "Write a jax.profiler trace of the timed run here (TensorBoard / Perfetto)")
# A peer in the same run
flags.DEFINE_enum("peer", "none", ["none", "hf"], "Also run transformers' batched generate (workload fixed)")

SHARED_PREFIX_TOKENS = {"none": 0, "1-shot": 80, "5-shot": 340}


def engine_kwargs(allocator: str, sharing: bool = True, kv_cache_dtype: str = "auto") -> dict:
    """LLM(...) settings for one run."""
    kwargs = dict(allocator=allocator, kv_cache_dtype=kv_cache_dtype, block_size=F.block_size,
                  max_model_len=F.max_model_len,
                  max_num_seqs=F.max_num_seqs, max_num_batched_tokens=F.max_num_batched_tokens, dtype=F.dtype,
                  enable_prefix_caching=sharing and F.shared_prefix != "none", share_forked_blocks=sharing,
                  tensor_parallel_size=F.tensor_parallel_size, data_parallel_size=F.data_parallel_size,
                  precompile=F.precompile, num_scheduler_steps=F.num_scheduler_steps,
                  cpu_packed_weights=F.cpu_packed_weights)
    if F.num_kv_blocks is not None:
        kwargs["num_kv_blocks"] = F.num_kv_blocks
    if F.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = F.kv_cache_memory_bytes
    return kwargs


def make_requests(prompts, output_lens, vocab_size: int, sharing: bool = True) -> list:
    """(prompt token ids, params) per request: greedy by default; n samples, beams, a shared prefix."""
    prefix = list(np.random.default_rng(1234).integers(3, vocab_size, SHARED_PREFIX_TOKENS[F.shared_prefix]))
    prefix = [int(t) for t in prefix]
    requests = []
    for i, (p, n) in enumerate(zip(prompts, output_lens)):
        prompt = prefix + p
        if F.beam_width:
            requests.append((prompt, BeamSearchParams(beam_width=F.beam_width, max_tokens=n, ignore_eos=True)))
        elif F.n > 1 and sharing:
            requests.append((prompt, SamplingParams(n=F.n, temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)))
        else:
            temperature = 1.0 if F.n > 1 else 0.0
            requests += [(prompt, SamplingParams(temperature=temperature, seed=i * F.n + k, max_tokens=n,
                                                 ignore_eos=True)) for k in range(F.n)]
    return requests


# ------------------------------------------------------------------------------------------
def run(llm: LLM, requests) -> dict:
    """Queues every request, steps the engine until all finish; throughput and batch statistics."""
    engine = llm.llm_engine
    replicas = getattr(engine, "replicas", [engine])
    for replica in replicas:
        replica.step_timings = StepTimings()
    compilations_before = llm.get_metrics()["num_compilations"]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    compile_start = COMPILE_SECONDS[0]
    start = time.perf_counter()
    tracing = jax.profiler.trace(F.trace_dir) if F.trace_dir else contextlib.nullcontext()
    with tracing:
        steps, batched, loaded_steps, loaded_batched, finished = _drive(engine)
    compiling = COMPILE_SECONDS[0] - compile_start
    elapsed = time.perf_counter() - start - compiling  # new shapes compile once; not throughput
    out_tokens = sum(len(c.token_ids) for o in finished for c in o.outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in finished)
    metrics = llm.get_metrics()
    flops = matmul_flops(engine.model_config, in_tokens + out_tokens, out_tokens)
    timings = [r.step_timings for r in replicas]
    first = replicas[0]
    memory = memory_floor_bytes(matmul_weights(first.model_config) * jnp.dtype(first.dtype).itemsize,
                                sum(t.steps for t in timings), first.input_processor.kv_bytes_per_block / F.block_size,
                                [(len(o.prompt_token_ids), len(c.token_ids)) for o in finished for c in o.outputs])
    return {"requests/s": len(finished) / elapsed, "tokens/s": (in_tokens + out_tokens) / elapsed,
            "output tokens/s": out_tokens / elapsed, "mean batch": batched / max(steps, 1),
            "matmul GFLOP/s": flops / elapsed / 1e9, "matmul FLOPs": flops, "memory floor bytes": memory,
            "loaded batch": loaded_batched / max(loaded_steps, 1),
            "preemptions": metrics["num_preemptions"], "steps": steps, "seconds": elapsed,
            "compile seconds": compiling, "new compilations": metrics["num_compilations"] - compilations_before,
            "compilations": metrics["num_compilations"], "blocks": metrics["num_total_blocks"],
            "peak blocks": round(metrics["peak_kv_cache_usage"] * metrics["num_total_blocks"]),
            "timings": timings}


def _drive(engine):
    """Steps the engine until every request has finished; (steps, batched, loaded steps, loaded
    batched, finished outputs)."""
    steps = batched = loaded_steps = loaded_batched = 0
    finished = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        batched += len(outputs)  # requests that advanced this step
        if any(e.scheduler.waiting for e in getattr(engine, "replicas", [engine])):  # memory pressure
            loaded_steps += 1
            loaded_batched += len(outputs)
        finished += [o for o in outputs if o.finished]
    return steps, batched, loaded_steps, loaded_batched, finished


def single_stream(llm: LLM, prompts, peak: float) -> None:
    """One request alone (the first 32 tokens of the second prompt, ``--single_stream`` greedy
    tokens) after a warm-up on the first: the per-token speed a lone user sees."""
    params = SamplingParams(temperature=0.0, max_tokens=F.single_stream, ignore_eos=True)
    timings = llm.llm_engine.step_timings
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], params, use_tqdm=False)
    timings.__init__()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompts[1][:32]}], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    gflops = matmul_flops(llm.llm_engine.model_config, 32 + F.single_stream, F.single_stream) / elapsed / 1e9
    print(f"single stream: {F.single_stream / elapsed:.1f} output tokens/s; matmuls {gflops:.1f} GFLOP/s = "
          f"{gflops / peak:.1%} of the GEMM peak" + (f"; step breakdown: {timings.summary()}" if F.profile else ""),
          flush=True)


def run_hf(model_dir: str, prompts, output_lens) -> float:
    """transformers' batched greedy generate on the same requests (equal lengths); output tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM

    if len(set(map(len, prompts))) != 1 or len(set(output_lens)) != 1:
        raise app.UsageError("--peer hf needs equal prompt and output lengths (--workload fixed)")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        model.generate(ids[:2, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=output_lens[0], min_new_tokens=output_lens[0], do_sample=False,
                       pad_token_id=0)
        elapsed = time.perf_counter() - start
    return len(prompts) * output_lens[0] / elapsed


def report(name: str, r: dict, num_requests: int, peak: float, bandwidth: float) -> None:
    roofline = roofline_seconds(r["matmul FLOPs"], r["memory floor bytes"], peak, bandwidth)
    print(f"{name:<12} Throughput: {r['requests/s']:.2f} requests/s, {r['tokens/s']:.2f} total tokens/s, "
          f"{r['output tokens/s']:.2f} output tokens/s;  matmuls {r['matmul GFLOP/s']:.1f} GFLOP/s = "
          f"{r['matmul GFLOP/s'] / peak:.1%} of the GEMM peak;  roofline {roofline:.1f} s ("
          f"{r['matmul FLOPs'] / 1e9:.0f} GFLOP at the peak, {r['memory floor bytes'] / 1e9:.0f} GB at "
          f"{bandwidth:.1f} GB/s: an estimate) = {roofline / r['seconds']:.1%} of the time;  mean batch {r['mean batch']:.2f} "
          f"({r['loaded batch']:.2f} while requests wait)  peak KV blocks {r['peak blocks']}  "
          f"preemptions {r['preemptions']}  steps {r['steps']}  {r['seconds']:.1f} s "
          f"(+{r['compile seconds']:.1f} s compiling, not counted)  "
          f"[{F.workload}, {num_requests} requests, {r['blocks']} blocks x {F.block_size}, "
          f"{r['compilations']} compilations, {r['new compilations']} during the run]", flush=True)
    if F.profile:
        for i, timings in enumerate(r["timings"]):
            print(f"{'':12s} step breakdown{f' (replica {i})' if len(r['timings']) > 1 else ''}: "
                  f"{timings.summary()}", flush=True)
            for line in timings.class_summary():
                print(f"{'':14s} {line}", flush=True)


def main(argv):
    del argv
    for a in F.allocator:
        if a not in ALLOCATORS:
            raise app.UsageError(f"--allocator: {a!r} is not one of {ALLOCATORS}")
    if (F.n > 1 or F.beam_width) and F.allocator != ["paged"]:
        raise app.UsageError("--n / --beam_width measure block sharing: run them with --allocator paged")
    if F.single_stream and F.num_requests is not None and F.num_requests < 2:
        raise app.UsageError("--single_stream needs --num_requests >= 2: the first prompt warms up, the "
                             "second is timed (one prompt twice would find its blocks in the prefix cache)")
    peak = describe_machine()
    bandwidth = memory_bandwidth_gbs()
    print(f"memory: {bandwidth:.1f} GB/s (XLA's matrix-vector product reading 1 GiB, best of 5, measured now)", flush=True)
    model = model_dir(F.model, F.cache_dir)
    results = {}
    sharing_modes = {"on": [True], "off": [False], "both": [True, False]}[F.sharing]
    for allocator in F.allocator:
        for sharing in sharing_modes:
            for kv in F.kv_cache_dtype:
                start = time.perf_counter()
                llm = LLM(model, **engine_kwargs(allocator, sharing, kv))
                print(f"{allocator}: start-up {time.perf_counter() - start:.1f} s "
                      f"({llm.get_metrics()['num_compilations']} step shapes compiled or loaded)", flush=True)
                vocab = llm.llm_engine.model_config.vocab_size
                prompts, output_lens = make_workload(F.workload, vocab, F.num_requests, F.seed,
                                                     F.length_scale)
                name = allocator if len(sharing_modes) == 1 else f"{allocator}/{'shared' if sharing else 'unshared'}"
                name = name if len(F.kv_cache_dtype) == 1 else f"{name}/kv={kv}"
                results[name] = run(llm, make_requests(prompts, output_lens, vocab, sharing))
                report(name, results[name], len(prompts), peak, bandwidth)
                if F.single_stream:
                    single_stream(llm, prompts, peak)
                del llm
    if len(F.kv_cache_dtype) > 1:
        base = F.kv_cache_dtype[0]
        for name, r in results.items():
            prefix, kv = name.rsplit("/kv=", 1)
            if kv != base:
                b = results[f"{prefix}/kv={base}"]
                print(f"kv {kv} / {base} ({prefix}): blocks {r['blocks'] / b['blocks']:.2f}x  "
                      f"output throughput {r['output tokens/s'] / b['output tokens/s']:.2f}x  "
                      f"mean batch {r['mean batch'] / b['mean batch']:.2f}x "
                      f"({r['loaded batch']:.2f} vs {b['loaded batch']:.2f} while requests wait)")
    if len(sharing_modes) == 2 and len(F.kv_cache_dtype) == 1:
        for allocator in F.allocator:
            on, off = results[f"{allocator}/shared"], results[f"{allocator}/unshared"]
            print(f"sharing on / off ({allocator}): output throughput {on['output tokens/s'] / off['output tokens/s']:.2f}x, "
                  f"peak KV blocks {on['peak blocks']} vs {off['peak blocks']} "
                  f"({1 - on['peak blocks'] / max(off['peak blocks'], 1):.1%} saved)")
    if F.peer == "hf":
        hf = run_hf(model, prompts, output_lens)
        first = next(iter(results.values()))
        print(f"transformers generate: {hf:.1f} output tokens/s; jpaged / transformers: "
              f"{first['output tokens/s'] / hf:.2f}x (same machine, same run)")
    if "paged" in results and len(sharing_modes) == 1 and len(F.kv_cache_dtype) == 1:
        p = results["paged"]
        for name, r in results.items():
            if name != "paged":
                loaded = (f"{p['loaded batch'] / r['loaded batch']:.2f}x" if r["loaded batch"] else "n/a")
                print(f"paged / {name:<6}  throughput {p['requests/s'] / r['requests/s']:.2f}x  "
                      f"mean batch {p['mean batch'] / r['mean batch']:.2f}x ({loaded} while requests wait)")


if __name__ == "__main__":
    app.run(main)
