"""Data parallelism: M engine replicas on disjoint device groups behind one engine interface.

Each replica has its own mesh (``tensor_parallel_size`` devices), weights, KV pool and scheduler.
A new request goes to the replica with the fewest tokens still to process; ``step`` advances
every replica that has work. On one host the replicas run one after another (JAX dispatch is
asynchronous, so their device work overlaps on accelerators).
"""
import jax

from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine


class DataParallelEngine:
    def __init__(self, config: EngineConfig, data_parallel_size: int, devices=None):
        devices = list(devices if devices is not None else jax.devices())
        tp = config.tensor_parallel_size
        if tp * data_parallel_size > len(devices):
            raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tp} needs "
                             f"{tp * data_parallel_size} devices; {len(devices)} available")
        self.replicas = [LLMEngine(config, devices=devices[i * tp:(i + 1) * tp]) for i in range(data_parallel_size)]
        self.placement: dict[str, LLMEngine] = {}

    @property
    def model_config(self):
        return self.replicas[0].model_config

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def input_processor(self):
        return self.replicas[0].input_processor

    @property
    def max_num_seqs(self) -> int:
        return sum(e.max_num_seqs for e in self.replicas)

    def process(self, request_id: str, prompt, sampling_params=None, **kwargs):
        return self.replicas[0].process(request_id, prompt, sampling_params, **kwargs)

    def _load(self, engine: LLMEngine) -> int:
        return sum(s.num_tokens - s.num_computed_tokens + (s.max_tokens or 0) - s.num_output_tokens
                   for r in engine.requests.values() for s in r.live_seqs)

    def add_request(self, request_id, prompt=None, sampling_params=None, **kwargs):
        """Queues a request (processed, or an id with its prompt) on the least loaded replica."""
        engine = min(self.replicas, key=self._load)
        request = engine.add_request(request_id, prompt, sampling_params, **kwargs)
        self.placement[request.request_id] = engine
        return request

    def abort_request(self, request_id: str):
        engine = self.placement.pop(str(request_id), None)
        return None if engine is None else engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def step(self):
        outputs = []
        for engine in self.replicas:
            if engine.has_unfinished_requests():
                outputs += engine.step()
        for out in outputs:
            if out.finished:
                self.placement.pop(out.request_id, None)
        return outputs

    # Training loops: every replica alike ------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self.replicas[0].paused

    @paused.setter
    def paused(self, value: bool) -> None:
        for engine in self.replicas:
            engine.paused = value

    @property
    def sleep_level(self) -> int:
        return self.replicas[0].sleep_level

    def update_weights(self, weights, draft_weights=None) -> None:
        """`LLMEngine.update_weights` on every replica (a mismatch raises at the first, before any change)."""
        for engine in self.replicas:
            engine.update_weights(weights, draft_weights=draft_weights)

    def sleep(self, level: int = 1) -> None:
        for engine in self.replicas:
            engine.check_idle("sleep", allow_paused=False)
        for engine in self.replicas:
            engine.sleep(level)

    def wake_up(self) -> None:
        for engine in self.replicas:
            engine.wake_up()

    def get_metrics(self) -> dict:
        """Counts summed over replicas, usages averaged; per-replica metrics under ``replicas``."""
        per = [e.get_metrics() for e in self.replicas]
        merged = {}
        for key, value in per[0].items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                merged[key] = value
            elif key in ("kv_cache_usage", "kv_cache_utilization", "peak_kv_cache_usage"):
                merged[key] = sum(m[key] for m in per) / len(per)
            else:
                merged[key] = sum(m[key] for m in per)
        merged["replicas"] = per
        if "spec_decode_num_drafts" in merged:  # rates from the summed counts
            from jpaged.spec_decode.stats import SpecDecodeStats
            positions = [m["spec_decode_accepted_per_position"] for m in per]
            summed = [sum(p[i] for p in positions if i < len(p)) for i in range(max(map(len, positions)))]
            merged.update(SpecDecodeStats(merged["spec_decode_num_drafts"], merged["spec_decode_num_draft_tokens"],
                                          merged["spec_decode_num_accepted_tokens"], summed).as_metrics())
        return merged
