"""Prefix-aware routing against round robin: 2 Ray Serve replicas, a multi-turn chat workload.

  python scripts/benchmark_routing.py                                  # bench-llama, defaults below
  python scripts/benchmark_routing.py --model path/to/hf_dir --conversations 16 --turns 4

For each ``--routings`` policy a fresh app (`jpaged.serve.ray.build_app`, ``--replicas`` replicas)
on a local Ray cluster serves ``--conversations`` chats at once, each turn by turn: a turn's prompt
(token ids, through ``/v1/completions``, streamed) is the conversation so far (one of
``--system_prompts`` shared system prompts, the earlier turns and answers) plus ``--user_tokens``
new tokens; it answers ``--output_tokens`` greedy tokens (the next turn appends stand-in answer
tokens of that length, so the cached prefix is the previous prompt). Reported per policy: the
prefix-cache hit rate over both replicas (cached / looked-up prompt tokens, from the replicas'
``jpaged:prefix_cache_*`` counters behind the gateway's ``/metrics``), the time to first token
(client side: request sent to first text chunk) p50 / p90, and the wall time.
"""
import json
import os
import socket
import sys
import threading
import time
import urllib.request

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import CACHE_DIR, model_dir  # noqa: E402

F = flags.FLAGS
flags.DEFINE_string("model", "bench-llama", "bench-llama | smollm2 | an HF checkpoint directory")
flags.DEFINE_string("cache_dir", CACHE_DIR, "Where bench-llama is built")
flags.DEFINE_list("routings", ["round_robin", "prefix"], "Policies to compare")
flags.DEFINE_integer("replicas", 2, "Engine replicas")
flags.DEFINE_float("num_cpus_per_replica", 1.0, "CPUs Ray reserves per replica")
flags.DEFINE_integer("conversations", 8, "Chats, run at once")
flags.DEFINE_integer("turns", 4, "Turns per chat")
flags.DEFINE_integer("system_prompts", 4, "Distinct shared system prompts")
flags.DEFINE_integer("system_tokens", 512, "Tokens of each system prompt")
flags.DEFINE_integer("user_tokens", 32, "New user tokens per turn")
flags.DEFINE_integer("output_tokens", 16, "Greedy tokens per answer")
flags.DEFINE_integer("num_kv_blocks", 512, "KV pool blocks per replica")
flags.DEFINE_integer("block_size", 16, "KV block size")
flags.DEFINE_integer("seed", 0, "Token ids of the prompts")
flags.DEFINE_bool("precompile", True, "Compile the step shapes before the replicas serve (as the server does)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def options(model: str) -> dict:
    max_len = F.system_tokens + F.turns * (F.user_tokens + F.output_tokens) + 16
    return {"model": model, "max_queued_requests": None, "served_model_name": "bench", "api_key": None,
            "chat_template": None, "max_request_body_bytes": 8 * 2**20, "allowed_origins": [],
            "enable_weight_updates": False, "tool_call_parser": None, "reasoning_parser": None,
            "enable_auto_tool_choice": False, "lora_modules": [],
            "engine_kwargs": {"num_kv_blocks": F.num_kv_blocks, "block_size": F.block_size,
                              "max_model_len": max_len, "max_num_seqs": max(8, F.conversations), "precompile": F.precompile}}


def stream_ttft(url: str, prompt: list[int]) -> float:
    """Seconds from sending the request to its first text chunk; reads the stream to its end."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": F.output_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    sent, first = time.perf_counter(), None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if first is None and line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                if event["choices"] and event["choices"][0]["text"]:
                    first = time.perf_counter()
    return (first or time.perf_counter()) - sent


def scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def replicas_ready(url: str) -> bool:
    try:
        samples = scrape(url)["jpaged:router_replica_ready"].samples
    except (OSError, KeyError):
        return False
    return len(samples) == F.replicas and all(s.value == 1 for s in samples)


def prefix_counters(url: str) -> tuple[float, float]:
    families = scrape(url)

    def total(name):
        family = families.get(name)
        return sum(s.value for s in family.samples if s.name.endswith("_total")) if family else 0.0

    return total("jpaged:prefix_cache_hits"), total("jpaged:prefix_cache_queries")


def run_policy(model: str, routing: str) -> dict:
    from ray import serve

    from jpaged.serve.ray import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(options(model), num_replicas=F.replicas, routing=routing, num_cpus=F.num_cpus_per_replica),
              name="jpaged", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1800
    while not replicas_ready(url):
        if time.monotonic() > deadline:
            raise SystemExit("the replicas did not get ready")
        time.sleep(1)
    rng = np.random.default_rng(F.seed)
    systems = [rng.integers(3, 30000, F.system_tokens).tolist() for _ in range(F.system_prompts)]
    chats = [(c % F.system_prompts, [rng.integers(3, 30000, F.user_tokens + F.output_tokens).tolist()
                                     for _ in range(F.turns)]) for c in range(F.conversations)]
    hits0, queries0 = prefix_counters(url)
    ttfts, errors = [], []

    def conversation(c):
        system, turns = chats[c]
        history = list(systems[system])
        for turn in turns:
            history += turn[:F.user_tokens]
            try:
                ttfts.append(stream_ttft(url, history))
            except Exception as e:  # noqa: BLE001 -- counted and reported
                errors.append(repr(e))
            history += turn[F.user_tokens:]  # the stand-in answer

    start = time.perf_counter()
    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(F.conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    hits, queries = prefix_counters(url)
    serve.delete("jpaged")
    serve.shutdown()
    return {"routing": routing, "prefix_hit_rate": (hits - hits0) / max(1.0, queries - queries0),
            "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p90_s": float(np.percentile(ttfts, 90)),
            "wall_s": wall, "requests": len(ttfts), "errors": errors}


def main(argv):
    del argv
    import ray

    model = model_dir(F.model, F.cache_dir) if not os.path.isdir(F.model) else F.model
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        results = [run_policy(model, routing) for routing in F.routings]
    finally:
        ray.shutdown()
    print(f"{'routing':<14} {'prefix hit rate':>16} {'TTFT p50 (s)':>13} {'TTFT p90 (s)':>13} {'wall (s)':>9}")
    for r in results:
        print(f"{r['routing']:<14} {r['prefix_hit_rate']:>16.3f} {r['ttft_p50_s']:>13.3f} {r['ttft_p90_s']:>13.3f} "
              f"{r['wall_s']:>9.1f}")
    print(json.dumps(results))


if __name__ == "__main__":
    app.run(main)
