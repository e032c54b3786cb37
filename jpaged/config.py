"""Engine settings as dataclasses, each validated once at construction."""
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}  # by EngineConfig.dtype name
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # CacheConfig.kv_cache_dtype; 8-bit: jpaged_kernels/quant.py
QUANTIZATIONS = ("int8", "gguf")  # EngineConfig.quantization values besides None


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
    enable_lora: bool = field(default=False, metadata={
        "help": "Serve LoRA adapters (PEFT directories) beside the base model, chosen per request "
                "(docs/lora.md)."})
    max_loras: int = field(default=1, metadata={
        "help": "LoRA adapters held on the device at once (its adapter slots); one step mixes any of them."})
    max_lora_rank: int = field(default=16, metadata={
        "help": "The largest LoRA rank served; every device slot is this rank (smaller ones zero-padded)."})
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "LoRA adapters kept loaded in host memory (least recently used evicted); None: max_loras."})

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
        if not isinstance(self.enable_expert_parallel, bool):
            _fail("EngineConfig", "enable_expert_parallel", self.enable_expert_parallel, "must be True or False")
        self._check_lora()

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            _fail("EngineConfig", "enable_lora", self.enable_lora, "must be True or False")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail("EngineConfig", name, value, "must be an integer >= 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int) \
                or self.max_cpu_loras < self.max_loras:
            _fail("EngineConfig", "max_cpu_loras", self.max_cpu_loras, f"must be an integer >= max_loras={self.max_loras}")

