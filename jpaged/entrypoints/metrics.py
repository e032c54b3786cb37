"""Prometheus metrics of the server, names prefixed ``jpaged:`` (vLLM's are ``vllm:``).

Beside them, the series of the Gateway API Inference Extension's model-server protocol (what its
endpoint picker, llm-d's and the GKE Inference Gateway read to route) under the names that protocol
gives, vLLM's: ``vllm:num_requests_waiting`` (TotalQueuedRequests), ``vllm:num_requests_running``
(TotalRunningRequests), ``vllm:kv_cache_usage_perc`` (KVCacheUtilization), ``vllm:cache_config_info``
(``block_size``, ``num_gpu_blocks``: what its prefix-cache scorer reads) and, with LoRA enabled,
``vllm:lora_requests_info`` (``max_lora``, ``running_lora_adapters``, ``waiting_lora_adapters``).

Per-request counters and latency histograms are updated on the engine thread through
`AsyncLLMEngine.on_output`; the engine's own gauges and counters (running and waiting requests, KV
cache, prefix cache, preemptions) are read from ``get_metrics()`` on the engine thread at each scrape.
"""
import asyncio
import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Gauges and counters from the latest engine snapshot (filled just before each scrape)."""

    def __init__(self, labels: dict):
        self.labels = labels
        self.snapshot: dict = {}
        self.running = self.waiting = 0
        self.lora: dict | None = None  # {"max_lora", "running", "waiting"} with LoRA enabled

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        s = self.snapshot

        def metric(family, name, doc, value):
            m = family(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        yield metric(GaugeMetricFamily, "jpaged:num_requests_running", "Requests the scheduler is running.",
                     self.running)
        yield metric(GaugeMetricFamily, "jpaged:num_requests_waiting", "Requests waiting to be scheduled.",
                     self.waiting)
        yield metric(GaugeMetricFamily, "jpaged:kv_cache_usage_perc", "Share of KV cache blocks in use (0-1).",
                     s.get("kv_cache_usage", 0.0))
        yield metric(GaugeMetricFamily, "jpaged:num_kv_blocks", "KV cache blocks in the pool.",
                     s.get("num_total_blocks", 0))
        yield metric(CounterMetricFamily, "jpaged:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     s.get("prefix_cache_queries", 0))
        yield metric(CounterMetricFamily, "jpaged:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     s.get("prefix_cache_hits", 0))
        yield metric(CounterMetricFamily, "jpaged:num_preemptions", "Requests preempted.",
                     s.get("num_preemptions", 0))
        yield from self._gateway_protocol(metric)
        if "kv_offload_host_hits" in s:  # prefix-cache tiers (docs/kv_offload.md)
            for tier in ("host", "disk"):
                yield metric(CounterMetricFamily, f"jpaged:kv_offload_{tier}_hits",
                             f"Prompt tokens loaded from the {tier} tier.", s[f"kv_offload_{tier}_hits"])
                yield metric(CounterMetricFamily, f"jpaged:kv_offload_{tier}_loaded_bytes",
                             f"Bytes loaded from the {tier} tier.", s[f"kv_offload_{tier}_loaded_bytes"])
                yield metric(CounterMetricFamily, f"jpaged:kv_offload_{tier}_stored_bytes",
                             f"Bytes stored into the {tier} tier.", s[f"kv_offload_{tier}_stored_bytes"])
                yield metric(GaugeMetricFamily, f"jpaged:kv_offload_{tier}_used_bytes",
                             f"Bytes the {tier} tier holds now.", s[f"kv_offload_{tier}_used_bytes"])
            yield metric(CounterMetricFamily, "jpaged:kv_offload_load_seconds",
                         "Seconds spent reading tier blocks and writing them into the device pool.",
                         s["kv_offload_load_seconds"])
        if "spec_decode_num_drafts" in s:  # speculative decoding (vLLM's vllm:spec_decode_* counters)
            for name, doc in (("num_drafts", "Sequence steps that verified proposals."),
                              ("num_draft_tokens", "Proposed tokens verified."),
                              ("num_accepted_tokens", "Proposed tokens accepted.")):
                yield metric(CounterMetricFamily, f"jpaged:spec_decode_{name}", doc, s[f"spec_decode_{name}"])
            yield metric(GaugeMetricFamily, "jpaged:spec_decode_acceptance_rate",
                         "Accepted / proposed tokens since start (0-1).", s["spec_decode_acceptance_rate"])
            yield metric(GaugeMetricFamily, "jpaged:spec_decode_mean_accepted_length",
                         "Tokens per verifying sequence step: accepted proposals + 1.",
                         s["spec_decode_mean_accepted_length"])


    def _gateway_protocol(self, metric):
        """The model-server protocol's series (the module docstring)."""
        s = self.snapshot
        yield metric(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", self.waiting)
        yield metric(GaugeMetricFamily, "vllm:num_requests_running", "Requests the scheduler is running.",
                     self.running)
        yield metric(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Share of KV cache blocks in use (0-1).",
                     s.get("kv_cache_usage", 0.0))
        names, values = list(self.labels), list(self.labels.values())
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration (labels).",
                                 labels=names + ["block_size", "num_gpu_blocks"])
        info.add_metric(values + [str(s.get("block_size", 0)), str(s.get("num_total_blocks", 0))], 1.0)
        yield info
        if self.lora is not None:
            lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of the running and waiting requests; "
                                     "the value is when this was read (Unix seconds).",
                                     labels=names + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            lora.add_metric(values + [str(self.lora["max_lora"]), ",".join(self.lora["running"]),
                                      ",".join(self.lora["waiting"])], time.time())
            yield lora


def _lora_adapters(engine) -> dict | None:
    """The adapters of the scheduler's running and waiting requests (on the engine thread), or None
    without LoRA (or for an engine without one scheduler)."""
    lora, scheduler = getattr(engine, "lora", None), getattr(engine, "scheduler", None)
    if lora is None or scheduler is None:
        return None

    def names(requests):
        return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})

    return {"max_lora": lora.max_loras, "running": names(scheduler.running), "waiting": names(scheduler.waiting)}


class ServerMetrics:
    def __init__(self, async_engine, model_name: str):
        prometheus_client.disable_created_metrics()  # no *_created series, as vLLM
        self.async_engine = async_engine
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._engine = _EngineCollector(labels)
        self.registry.register(self._engine)
        names = list(labels)

        def make(cls, name, doc, extra=(), **kw):
            return cls(name, doc, names + list(extra), registry=self.registry, **kw)

        self.prompt_tokens = make(Counter, "jpaged:prompt_tokens", "Prompt tokens of finished or running requests.")
        self.generation_tokens = make(Counter, "jpaged:generation_tokens", "Tokens generated.")
        self.request_success = make(Counter, "jpaged:request_success", "Requests ended, by finish reason.",
                                    ("finished_reason",))
        self.ttft = make(Histogram, "jpaged:time_to_first_token_seconds", "Arrival to first token.",
                         buckets=LATENCY_BUCKETS)
        self.itl = make(Histogram, "jpaged:inter_token_latency_seconds", "Time between a request's tokens.",
                        buckets=LATENCY_BUCKETS)
        self.e2e = make(Histogram, "jpaged:e2e_request_latency_seconds", "Arrival to finish.",
                        buckets=LATENCY_BUCKETS)
        self._label_values = list(labels.values())
        self._last_token_time: dict[str, float] = {}
        self._seen: set[str] = set()

    def _m(self, metric, *extra):
        return metric.labels(*self._label_values, *extra)

    def on_output(self, out, num_new_tokens: int, now: float) -> None:
        """Called by the engine thread for each output (see `AsyncLLMEngine`)."""
        rid = out.request_id
        if rid not in self._seen:
            self._seen.add(rid)
            self._m(self.prompt_tokens).inc(len(out.prompt_token_ids))
        if num_new_tokens > 0:
            self._m(self.generation_tokens).inc(num_new_tokens)
            last = self._last_token_time.get(rid)
            if last is None:
                m = out.metrics
                start = m.arrival_time if m is not None else now
                first = m.first_token_time if m is not None and m.first_token_time is not None else now
                self._m(self.ttft).observe(max(0.0, first - start))
            else:
                self._m(self.itl).observe(max(0.0, now - last))
            self._last_token_time[rid] = now
        if out.finished:
            self._seen.discard(rid)
            self._last_token_time.pop(rid, None)
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
            self._m(self.request_success, reason).inc()
            if out.metrics is not None:
                self._m(self.e2e).observe(max(0.0, now - out.metrics.arrival_time))

    async def render(self) -> bytes:
        """The Prometheus text exposition, with a fresh engine snapshot."""
        snapshot = await self.async_engine.get_metrics()  # read on the engine thread, between steps
        self._engine.snapshot = snapshot
        # the scheduler's own queue lengths: exact (a preempted request is waiting again, a request in
        # chunked prefill is running); the front's counts only for an engine that does not report them
        self._engine.running = snapshot.get("num_running_requests", self.async_engine.num_running)
        self._engine.waiting = snapshot.get("num_waiting_requests", self.async_engine.num_waiting)
        engine = getattr(self.async_engine, "engine", None)
        if getattr(engine, "lora", None) is not None:
            self._engine.lora = await asyncio.wrap_future(self.async_engine.call(lambda: _lora_adapters(engine)))
        return generate_latest(self.registry)
