"""Engine settings as dataclasses, each validated once at construction."""
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}  # by EngineConfig.dtype name
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # CacheConfig.kv_cache_dtype; 8-bit: jpaged_kernels/quant.py
QUANTIZATIONS = ("int8", "gguf")  # EngineConfig.quantization values besides None
LOGPROBS_MODES = {"raw_logprobs": "raw_logprobs", "processed_logprobs": "processed_logprobs",  # vLLM's names
                  "raw": "raw_logprobs", "processed": "processed_logprobs"}                  # and the short ones


def check_quantization(quantization, model) -> None:
    """ValueError for a ``quantization`` that is unknown or does not fit the checkpoint ``model``
    (a path; None is the embedded default, a GGUF file)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: must be None, "
                         f"{' or '.join(map(repr, QUANTIZATIONS))}")
    if quantization == "gguf" and model is not None and not (isinstance(model, str) and model.endswith(".gguf")):
        raise ValueError(f"quantization='gguf': keeps the blocks of a GGUF file, but model={model!r} is "
                         "not a .gguf file (quantization='int8' quantizes any checkpoint)")


def _fail(cls, name, value, why):
    raise ValueError(f"{cls}.{name}={value!r}: {why}")


@dataclass
class CacheConfig:
    """The paged KV cache: block size and how many blocks the pool holds."""

    block_size: int = 16
    kv_cache_dtype: str = "auto"              # "auto" (the model dtype) | "int8" | "fp8" (float8_e4m3fn),
                                              # 8-bit pages with a scale per (token, kv head)
    num_kv_blocks: int | None = None          # explicit pool size, wins over the byte budgets
    kv_cache_memory_bytes: int | None = None  # explicit byte budget for the pool
    memory_utilization: float = 0.9           # share of device memory (after weights) for the pool
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"        # or "swap"
    swap_space_bytes: int = 4 << 30
    cpu_default_bytes: int = 256 << 20        # pool budget where devices report no memory (CPU)
    allocator: str = "paged"                  # benchmarks only: "max" | "pow2" | "oracle" reserve
                                              # contiguous runs per request, as Orca did
    share_forked_blocks: bool = True          # benchmarks only: False copies every block on fork
                                              # (needs the room at once: raises when a fork cannot copy)

    def __post_init__(self):
        bs = self.block_size
        if not (isinstance(bs, int) and 1 <= bs <= 256 and bs & (bs - 1) == 0):
            _fail("CacheConfig", "block_size", bs, "must be a power of two from 1 to 256")
        if self.num_kv_blocks is not None and not (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1):
            _fail("CacheConfig", "num_kv_blocks", self.num_kv_blocks, "must be an integer >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            _fail("CacheConfig", "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be > 0")
        if not 0 < self.memory_utilization <= 1:
            _fail("CacheConfig", "memory_utilization", self.memory_utilization, "must be in (0, 1]")
        if self.preemption_mode not in ("recompute", "swap"):
            _fail("CacheConfig", "preemption_mode", self.preemption_mode, "must be 'recompute' or 'swap'")
        if self.allocator not in ("paged", "max", "pow2", "oracle"):
            _fail("CacheConfig", "allocator", self.allocator, "must be 'paged', 'max', 'pow2' or 'oracle'")
        if self.swap_space_bytes < 0:
            _fail("CacheConfig", "swap_space_bytes", self.swap_space_bytes, "must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            _fail("CacheConfig", "kv_cache_dtype", self.kv_cache_dtype, "must be 'auto', 'int8' or 'fp8'")


def check_kv_cache_dtype(kv_cache_dtype: str, attention_backend: str, platform: str,
                         compute_capability: str | None = None) -> None:
    """Raises ValueError for a KV cache dtype the chosen attention backend cannot run on this platform.

    fp8 (float8_e4m3fn) with the Pallas kernels needs hardware float8: on CUDA, Triton converts
    float8_e4m3fn only from compute capability 8.9 (Ada, Hopper); on TPU, Mosaic's float8 casts are
    not verified here, so fp8 runs on TPU with ``attention_backend="xla"`` only. int8 runs
    everywhere; the XLA path runs every dtype on every platform.
    """
    if kv_cache_dtype != "fp8" or attention_backend != "pallas":
        return
    if platform == "tpu":
        _fail("CacheConfig", "kv_cache_dtype", kv_cache_dtype,
              "the Pallas kernels' float8 path is not supported on TPU; use 'int8' or attention_backend='xla'")
    if platform == "gpu" and compute_capability is not None:
        major, minor = (int(x) for x in str(compute_capability).split(".")[:2])
        if (major, minor) < (8, 9):
            _fail("CacheConfig", "kv_cache_dtype", kv_cache_dtype,
                  f"float8_e4m3fn needs CUDA compute capability >= 8.9, this GPU has {compute_capability}; "
                  "use 'int8'")


@dataclass
class SchedulerConfig:
    """Continuous batching limits per engine step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # filled from the model when None
    # Decode steps per host round trip: when every scheduled sequence is decoding, up to this many
    # steps run back to back on the device (`Scheduler.plan_decode_window`).
    num_scheduler_steps: int = 1

    def __post_init__(self):
        if not (isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1):
            _fail("SchedulerConfig", "max_num_seqs", self.max_num_seqs, "must be an integer >= 1")
        if not (isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1):
            _fail("SchedulerConfig", "max_num_batched_tokens", self.max_num_batched_tokens,
                  "must be an integer >= 1")
        if self.max_model_len is not None and not (isinstance(self.max_model_len, int) and self.max_model_len >= 1):
            _fail("SchedulerConfig", "max_model_len", self.max_model_len, "must be an integer >= 1")
        if not (isinstance(self.num_scheduler_steps, int) and self.num_scheduler_steps >= 1):
            _fail("SchedulerConfig", "num_scheduler_steps", self.num_scheduler_steps, "must be an integer >= 1")


@dataclass
class EngineConfig:
    """Everything `LLM(...)` takes, grouped."""

    model: str | None = None
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    attention_backend: str = "auto"   # "pallas" | "xla" | "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation_cache_dir: str | None = None  # None: ~/.cache/jpaged/jax
    quantization: str | None = None   # weights: None (as stored / dtype), "int8" (per output channel,
                                      # made at load time), "gguf" (a GGUF file's Q8_0/Q4_0/Q4_1 kept)
    precompile: bool = False  # compile every step shape at start (servers): none compiles while serving
    speculative_config: object = None  # a SpeculativeConfig, its dict or JSON text (docs/speculative.md)
    enable_expert_parallel: bool = False  # mixture-of-experts models: whole experts per device over the
                                          # tensor_parallel_size devices (else each expert split like an MLP)
    logprobs_mode: str = field(default="raw_logprobs", metadata={
        "help": "What SamplingParams(logprobs=k) reports: 'raw_logprobs' (or 'raw'), the model's log-softmax; "
                "'processed_logprobs' (or 'processed'), the distribution each token was sampled from (after "
                "logit bias, masks, penalties, temperature, top-k/top-p/min-p)",
        "choices": tuple(LOGPROBS_MODES)})

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            _fail("EngineConfig", "dtype", self.dtype, "must be 'auto', 'float32', 'bfloat16' or 'float16'")
        if self.attention_backend not in ("auto", "pallas", "xla"):
            _fail("EngineConfig", "attention_backend", self.attention_backend,
                  "must be 'auto', 'pallas' or 'xla'")
        check_quantization(self.quantization, self.model)  # before any device work
        if not (isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1):
            _fail("EngineConfig", "data_parallel_size", self.data_parallel_size, "must be an integer >= 1")
        if not (isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1):
            _fail("EngineConfig", "tensor_parallel_size", self.tensor_parallel_size, "must be an integer >= 1")
        from jpaged.spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.speculative_config is not None:
            method = self.speculative_config.method
            if self.scheduler.num_scheduler_steps > 1:
                raise ValueError(f"speculative_config (method={method!r}) and num_scheduler_steps="
                                 f"{self.scheduler.num_scheduler_steps} (decode windows) do not combine: set one")
            if self.cache.allocator != "paged":
                raise ValueError(f"speculative_config (method={method!r}) needs allocator='paged', not "
                                 f"allocator={self.cache.allocator!r} (a reservation baseline)")
        if self.logprobs_mode not in LOGPROBS_MODES:
            _fail("EngineConfig", "logprobs_mode", self.logprobs_mode, f"must be one of {', '.join(LOGPROBS_MODES)}")
        self.logprobs_mode = LOGPROBS_MODES[self.logprobs_mode]
        if not isinstance(self.enable_expert_parallel, bool):
            _fail("EngineConfig", "enable_expert_parallel", self.enable_expert_parallel, "must be True or False")

