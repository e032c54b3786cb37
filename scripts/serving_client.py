"""benchmark_serving.py's HTTP mode: a workload sent to any OpenAI-compatible server.

Requests (prompt token ids, output length) go to ``POST /v1/completions`` as Poisson arrivals
through the `openai` async client, streamed, greedy, with ``ignore_eos`` (a vLLM extension jpaged
shares) so each request produces its workload length. Per request: the arrival, each chunk's
arrival (a chunk is one engine step's new text, about one token), the finish and the server's
``usage.completion_tokens``. Reported: request throughput, output tokens/s, and TTFT (arrival to
first chunk), TPOT ((finish - first chunk) / (tokens - 1)) and ITL (gaps between chunks) as mean,
p50 and p99.
"""
import asyncio
import logging
import time

import numpy as np


async def _one(client, model: str, prompt: list[int], max_tokens: int, start: float, delay: float) -> dict:
    await asyncio.sleep(delay)
    record = {"arrival": time.perf_counter() - start, "chunk_times": [], "tokens": 0}
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter() - start
        if chunk.choices:
            record["chunk_times"].append(now)
        if chunk.usage is not None:
            record["tokens"] = chunk.usage.completion_tokens
    record["finish"] = time.perf_counter() - start
    return record


async def run(base_url: str, api_key: str, model: str | None, requests, arrivals) -> list[dict]:
    """Sends ``requests`` [(prompt ids, max_tokens)] at ``arrivals`` (seconds); one record each."""
    import openai

    for name in ("httpx", "httpx2", "openai"):  # one log line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0, timeout=3600)
    try:
        if model is None:
            model = (await client.models.list()).data[0].id
        start = time.perf_counter()
        return await asyncio.gather(*(_one(client, model, p, n, start, float(t))
                                      for (p, n), t in zip(requests, arrivals)))
    finally:
        await client.close()


def summarize(records: list[dict]) -> dict:
    """Request throughput, output tok/s and TTFT / TPOT / ITL (seconds) over the run."""
    ttft = [r["chunk_times"][0] - r["arrival"] for r in records if r["chunk_times"]]
    tpot = [(r["finish"] - r["chunk_times"][0]) / (r["tokens"] - 1)
            for r in records if r["chunk_times"] and r["tokens"] > 1]
    itl = [b - a for r in records for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    span = max(r["finish"] for r in records) - min(r["arrival"] for r in records)
    stats = {"requests/s": len(records) / span, "output tok/s": sum(r["tokens"] for r in records) / span}
    for name, xs in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl)):
        xs = np.asarray(xs or [0.0])
        stats[name] = {"mean": float(xs.mean()), "p50": float(np.percentile(xs, 50)),
                       "p99": float(np.percentile(xs, 99))}
    return stats


def report(rate: float, s: dict) -> str:
    ms = lambda k: "/".join(f"{s[k][q] * 1e3:.1f}" for q in ("mean", "p50", "p99"))  # noqa: E731
    return (f"http    rate {rate:>5.2f}/s  {s['requests/s']:.2f} requests/s  {s['output tok/s']:.1f} output tok/s  "
            f"TTFT mean/p50/p99 {ms('TTFT')} ms  TPOT {ms('TPOT')} ms  ITL {ms('ITL')} ms")


def main(base_url: str, api_key: str, model: str | None, requests, rates, arrivals_fn, warmup: int) -> None:
    """One run per rate (after ``warmup`` requests sent at once, not measured), one line each."""
    if warmup:
        asyncio.run(run(base_url, api_key, model, requests[:warmup], [0.0] * min(warmup, len(requests))))
    for rate in rates:
        records = asyncio.run(run(base_url, api_key, model, requests, arrivals_fn(rate)))
        print(report(rate, summarize(records)), flush=True)
