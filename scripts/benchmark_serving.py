"""Online serving: Poisson arrivals fed to LLMEngine in-process; latency against request rate.

  python scripts/benchmark_serving.py --allocator paged,oracle,max --request_rates 1,2,4 --num_kv_blocks 256
  python scripts/benchmark_serving.py --workload alpaca-like --num_requests 64 --request_rates 2,8,16

Reproduces the shape of the vLLM paper's Figure 12: for each allocator and request rate, requests
from ``scripts/workloads.py`` arrive as a Poisson process (exponential gaps, fixed seed) and
are added to the engine when their time comes, between steps; the engine steps while it has work
and sleeps until the next arrival when idle. Prints per run the normalized latency (the mean over
requests of end-to-end seconds / output tokens), TTFT (arrival to first token), TPOT (first to last
token, per token after the first) and ITL (gaps between consecutive tokens) percentiles, and plots
normalized latency against rate, one line per allocator (``--out_dir``/serving.png).

With ``--base_url`` the same workload goes over HTTP to an OpenAI-compatible server instead (this
project's ``scripts/serve.py`` or ``vllm serve``; see serving_client.py), reporting request and
output-token throughput and TTFT / TPOT / ITL.

Takes the model, workload and engine flags of benchmark_throughput.py. Before measuring, each engine
serves ``--warmup_requests`` requests offline, so most compilations happen outside the timed runs.
"""
import os
import time
from collections import deque

import numpy as np
from absl import app, flags

import benchmark_throughput as bt
from bench_common import REPO_ROOT, bench_model_dir
from workloads import make_workload
from jpaged import LLM

F = flags.FLAGS
flags.DEFINE_list("request_rates", ["1", "2", "4"], "Mean arrivals per second (Poisson)")
flags.DEFINE_integer("arrival_seed", 0, "Seed of the arrival times")
flags.DEFINE_integer("warmup_requests", 8, "Requests served offline first (compilations), not measured")
flags.DEFINE_string("out_dir", os.path.join(REPO_ROOT, "docs"), "Where serving.png goes ('' for none)")
# HTTP mode (serving_client.py): the same workload sent to an OpenAI-compatible server
flags.DEFINE_string("base_url", None, "e.g. http://127.0.0.1:8000/v1: benchmark that server instead of in-process")
flags.DEFINE_string("api_key", None, "HTTP mode: the server's API key")
flags.DEFINE_string("served_model", None, "HTTP mode: model name to send (default: the server's first)")
flags.DEFINE_integer("http_vocab_size", 32000, "HTTP mode: vocabulary the workload's token ids are drawn from")


def poisson_arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """Arrival times (seconds from the start) of n requests at ``rate`` per second."""
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


def serve(llm: LLM, requests, arrivals, tag: str) -> list[dict]:
    """Feeds requests at their arrival times; per request: arrival, token times, finish."""
    engine = llm.llm_engine
    pending = deque(zip(arrivals, range(len(requests))))
    records = [{"arrival": float(t), "token_times": []} for t in arrivals]
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, i = pending.popleft()
            prompt, params = requests[i]
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            rec = records[int(out.request_id.rsplit("-", 1)[1])]
            new = len(out.outputs[0].token_ids) - len(rec["token_times"])
            rec["token_times"] += [now] * max(new, 0)
            if out.finished:
                rec["finish"] = now
    return records


def summarize(records: list[dict]) -> dict:
    """Normalized latency and TTFT / TPOT / ITL statistics, in seconds."""
    norm = [(r["finish"] - r["arrival"]) / len(r["token_times"]) for r in records]
    ttft = [r["token_times"][0] - r["arrival"] for r in records]
    tpot = [(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
            for r in records if len(r["token_times"]) > 1]
    itl = [b - a for r in records for a, b in zip(r["token_times"], r["token_times"][1:])]
    span = max(r["finish"] for r in records) - min(r["arrival"] for r in records)
    stats = {"normalized latency": float(np.mean(norm)), "requests/s": len(records) / span}
    for name, xs in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl)):
        xs = np.asarray(xs or [0.0])
        stats[name] = {"mean": float(xs.mean()), **{f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)}}
    return stats


def plot(results: dict[str, dict[float, dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for allocator, by_rate in results.items():
        rates = sorted(by_rate)
        ax.plot(rates, [by_rate[r]["normalized latency"] for r in rates], marker="o", label=allocator)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"{F.workload}, {F.num_kv_blocks} KV blocks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv):
    del argv
    rates = [float(r) for r in F.request_rates]
    if F.base_url:
        return http_main(rates)
    model = F.model or bench_model_dir(F.cache_dir)
    results: dict[str, dict[float, dict]] = {}
    for allocator in F.allocator:
        llm = LLM(model, **bt.engine_kwargs(allocator))
        vocab = llm.llm_engine.model_config.vocab_size
        prompts, output_lens = make_workload(F.workload, vocab, F.num_requests, F.seed,
                                             F.length_scale)
        requests = bt.make_requests(prompts, output_lens, vocab)
        if F.warmup_requests:
            llm.generate([{"prompt_token_ids": p} for p, _ in requests[:F.warmup_requests]],
                         [s for _, s in requests[:F.warmup_requests]], use_tqdm=False)
        for rate in rates:
            before = llm.get_metrics()["num_preemptions"]
            records = serve(llm, requests, poisson_arrivals(rate, len(requests), F.arrival_seed), f"{rate}")
            s = results.setdefault(allocator, {})[rate] = summarize(records)
            pct = lambda k: "/".join(f"{s[k][q] * 1e3:.0f}" for q in ("p50", "p90", "p99"))  # noqa: E731
            print(f"{allocator:<7} rate {rate:>5.2f}/s  normalized latency {s['normalized latency']:.3f} s/token  "
                  f"{s['requests/s']:.2f} requests/s  TTFT p50/90/99 {pct('TTFT')} ms  TPOT {pct('TPOT')} ms  "
                  f"ITL {pct('ITL')} ms  preemptions {llm.get_metrics()['num_preemptions'] - before}", flush=True)
        del llm
    if F.out_dir:
        os.makedirs(F.out_dir, exist_ok=True)
        path = os.path.join(F.out_dir, "serving.png")
        plot(results, path)
        print(f"wrote {path}")


def http_main(rates: list[float]) -> None:
    import serving_client

    prompts, output_lens = make_workload(F.workload, F.http_vocab_size, F.num_requests, F.seed, F.length_scale)
    requests = list(zip(prompts, output_lens))
    serving_client.main(F.base_url, F.api_key, F.served_model, requests, rates,
                        lambda rate: poisson_arrivals(rate, len(requests), F.arrival_seed), F.warmup_requests)


if __name__ == "__main__":
    app.run(main)
