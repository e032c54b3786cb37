"""Engine settings as dataclasses, each validated once at construction."""
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}  # by EngineConfig.dtype name
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # CacheConfig.kv_cache_dtype; 8-bit: pallas_kernels/quant.py
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
class KVOffloadConfig:
    """Prefix-cache tiers below the device pool (`jpaged.core.kv_offload`, docs/kv_offload.md)."""

    host_bytes: int = field(default=0, metadata={
        "help": "host memory for full prefix-cache blocks evicted from the device pool (0: no host tier)"})
    disk_path: str | None = field(default=None, metadata={
        "help": "directory of the disk tier, kept across restarts (None: no disk tier)"})
    disk_bytes: int = field(default=0, metadata={
        "help": "most bytes the disk tier keeps under disk_path (least recently used files go first)"})

    def __post_init__(self):
        for name in ("host_bytes", "disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                _fail("kv_offload", name, value, "must be an integer >= 0")
        if self.disk_path is not None and not (isinstance(self.disk_path, str) and self.disk_path):
            _fail("kv_offload", "disk_path", self.disk_path, "must be a directory path or None")
        if self.disk_bytes and self.disk_path is None:
            _fail("kv_offload", "disk_bytes", self.disk_bytes, "needs a disk_path")
        if self.disk_path is not None and not self.disk_bytes:
            _fail("kv_offload", "disk_bytes", self.disk_bytes, "must be > 0 with a disk_path")

    @classmethod
    def of(cls, value) -> "KVOffloadConfig | None":
        """A config from itself, a dict, JSON text (a command-line flag) or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as error:
                raise ValueError(f"kv_offload={value!r}: not JSON ({error})") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"kv_offload={value!r}: must be a dict with host_bytes, disk_path, disk_bytes")
        unknown = set(value) - {"host_bytes", "disk_path", "disk_bytes"}
        if unknown:
            raise ValueError(f"kv_offload: unknown field(s) {sorted(unknown)}; known: host_bytes, disk_path, "
                             "disk_bytes")
        config = cls(**value)
        return config if config.host_bytes or config.disk_path else None


@dataclass
class CacheConfig:
    """The paged KV cache: block size and how many blocks the pool holds."""

    block_size: int = field(default=16, metadata={"help": "Tokens per KV block: a power of two from 1 to 256"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache storage: auto (the model dtype), or int8 / fp8 (float8_e4m3fn) pages with a "
                "bfloat16 scale per token and KV head", "choices": KV_CACHE_DTYPES})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "KV pool size in blocks (>= 1); wins over the byte budgets"})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": "KV pool size in bytes (> 0); wins over memory_utilization"})
    memory_utilization: float = field(default=0.9, metadata={
        "help": "Share of the accelerator's memory, in (0, 1], for the weights and the KV pool: the pool "
                "gets it less what is in use once the weights are loaded (ahead of time, scripts/aot_compile.py: "
                "less the weights and the largest step's temporaries); unused on the CPU"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "Automatic prefix caching: requests sharing a prompt prefix share its full KV blocks"})
    preemption_mode: str = field(default="recompute", metadata={
        "help": "How to preempt when the pool is full: recompute the KV later, or swap it to host memory",
        "choices": ("recompute", "swap")})
    swap_space_bytes: int = field(default=4 << 30, metadata={
        "help": "Host memory (bytes, >= 0) for swapped-out KV blocks (preemption_mode=swap)"})
    cpu_default_bytes: int = field(default=256 << 20, metadata={
        "help": "KV pool budget in bytes where devices report no memory (CPU)"})
    allocator: str = field(default="paged", metadata={
        "help": "KV allocation: paged (blocks on demand), or, for benchmarks only, max / pow2 / oracle: "
                "contiguous runs reserved per request, as Orca did", "choices": ("paged", "max", "pow2", "oracle")})
    share_forked_blocks: bool = field(default=True, metadata={
        "help": "Forked sequences (n > 1, beams) share blocks by reference count; benchmarks only: false "
                "copies every block on fork (needs the room at once: raises when a fork cannot copy)"})
    kv_offload: object = field(default=None, metadata={
        "help": "prefix-cache tiers below the device pool, a dict or JSON: "
                '{"host_bytes": N, "disk_path": DIR, "disk_bytes": N} (docs/kv_offload.md)'})

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
        self.kv_offload = KVOffloadConfig.of(self.kv_offload)
        if self.kv_offload is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload: keeps prefix-cache blocks, but enable_prefix_caching=False")
        if self.kv_offload is not None and self.allocator != "paged":
            raise ValueError(f"kv_offload: needs allocator='paged', not allocator={self.allocator!r}")


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

    max_num_seqs: int = field(default=256, metadata={"help": "Sequences per engine step (>= 1)"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "Tokens per engine step (>= 1): prefill chunks and decodes together"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "Longest prompt + output in tokens (>= 1); unset: the model's context length"})
    num_scheduler_steps: int | None = field(default=None, metadata={
        "help": "Decode steps per host round trip (>= 1): up to this many decode steps run back to back "
                "on the device when every sequence decodes (decode windows, Scheduler.plan_decode_window); "
                "unset: 8 on the CPU (without speculative decoding), 1 on TPU/GPU"})

    def __post_init__(self):
        if not (isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1):
            _fail("SchedulerConfig", "max_num_seqs", self.max_num_seqs, "must be an integer >= 1")
        if not (isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1):
            _fail("SchedulerConfig", "max_num_batched_tokens", self.max_num_batched_tokens,
                  "must be an integer >= 1")
        if self.max_model_len is not None and not (isinstance(self.max_model_len, int) and self.max_model_len >= 1):
            _fail("SchedulerConfig", "max_model_len", self.max_model_len, "must be an integer >= 1")
        if self.num_scheduler_steps is not None and not (isinstance(self.num_scheduler_steps, int)
                                                         and self.num_scheduler_steps >= 1):
            _fail("SchedulerConfig", "num_scheduler_steps", self.num_scheduler_steps, "must be an integer >= 1")


@dataclass
class EngineConfig:
    """Everything `LLM(...)` takes, grouped."""

    model: str | None = field(default=None, metadata={
        "help": "HF directory, .gguf file or preset; unset: --config's model, else the embedded "
                "SmolLM2-135M-Instruct"})
    dtype: str = field(default="auto", metadata={
        "help": "Weights and KV cache dtype; auto: bfloat16 on TPU/GPU, float32 on the CPU",
        "choices": ("auto", *DTYPES)})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "Devices to shard attention heads and MLP weights over (>= 1)", "group": "parallelism"})
    data_parallel_size: int = field(default=1, metadata={
        "help": "Engine replicas (>= 1), each on its own tensor_parallel_size devices; a new request goes "
                "to the one with the fewest tokens still to process",
        "group": "parallelism"})
    attention_backend: str = field(default="auto", metadata={
        "help": "Attention implementation; auto: pallas on TPU/GPU, xla on the CPU",
        "choices": ("auto", "pallas", "xla")})
    seed: int = field(default=0, metadata={
        "help": "The engine's random seed (requests without a seed of their own draw from it)",
        "flag": "engine_seed"})
    cache: CacheConfig = field(default_factory=CacheConfig, metadata={
        "help": "The paged KV cache", "group": "cache"})
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig, metadata={
        "help": "Continuous batching limits", "group": "scheduler"})
    compilation_cache_dir: str | None = field(default=None, metadata={
        "help": "JAX's persistent compilation cache directory; unset: ~/.cache/jpaged/jax/<host key> (jaxlib version and processor)"})
    quantization: str | None = field(default=None, metadata={
        "help": "Weight-only quantization: int8 per output channel (made at load time, any checkpoint), or "
                "gguf (a .gguf file's Q8_0/Q4_0/Q4_1 blocks kept as stored); unset: weights as loaded",
        "choices": QUANTIZATIONS})
    cpu_packed_weights: bool = field(default=True, metadata={
        "help": "On the CPU, a float32 model's projections also kept packed panel by panel for the C++ "
                "matmul, which streams them from memory faster (docs/cpu.md); costs their memory once more"})
    precompile: bool = field(default=False, metadata={
        "help": "Compile every step shape at start, so that none compiles while serving (the server's default)"})
    speculative_config: object = field(default=None, metadata={
        "help": 'Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                '\'{"method": "draft_model", "model": "path/or/preset", "num_speculative_tokens": 4}\' '
                "(docs/speculative.md)"})
    enable_expert_parallel: bool = field(default=False, metadata={
        "help": "Mixture-of-experts models: whole experts per device over the tensor_parallel_size devices "
                "(else each expert is split like an MLP)", "group": "parallelism"})
    logprobs_mode: str = field(default="raw_logprobs", metadata={
        "help": "What SamplingParams(logprobs=k) reports: 'raw_logprobs' (or 'raw'), the model's log-softmax; "
                "'processed_logprobs' (or 'processed'), the distribution each token was sampled from (after "
                "logit bias, masks, penalties, temperature, top-k/top-p/min-p)",
        "choices": tuple(LOGPROBS_MODES)})
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
            if (self.scheduler.num_scheduler_steps or 1) > 1:
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

