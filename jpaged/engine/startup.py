"""Start-up: from an `EngineConfig` (resolved from `LLM`'s keyword arguments by
`jpaged.config_resolution.engine_config`) to the engine's parts (`build`), each decided once.

The platform decides the defaults (bfloat16 and the Pallas kernels on TPU/GPU, float32 and the
``xla`` backend with the C++ kernels on the CPU); the model is loaded (or taken as given) onto a
mesh of ``tensor_parallel_size`` devices; its layers' sliding windows decide the KV-cache groups
(`kv_cache_layout`: one, or a group per window for a model that mixes them); a model with
recurrent layers gets a state slot per sequence besides (`jpaged.core.recurrent_state`); the KV
pool is sized from ``num_kv_blocks`` or a byte budget; then the KV cache manager, the scheduler and
the model runner are built and the step shapes compiled.
"""
import dataclasses
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from pallas_kernels.cpu.library import available as cpu_kernels_available, cpu_id
from jpaged import sharding
from jpaged.config import DTYPES, CacheConfig, EngineConfig, check_kv_cache_dtype
from jpaged.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jpaged.core.kv_cache_layout import KVCacheLayout, kv_cache_layout
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.kv_offload import KVOffload
from jpaged.core.kv_offload import namespace as kv_namespace
from jpaged.core.recurrent_state import RecurrentStateCache
from jpaged.core.scheduler import Scheduler
from jpaged.loading.model_loader import load_model
from jpaged.logger import logger
from jpaged.models.attention import attention_windows, recurrent_state_arrays, resolve_backend
from jpaged.progress import phase
from jpaged.runner import kv_pool, precompile
from jpaged.runner.buckets import StepBuckets
from jpaged.runner.compile_counter import CompileCounter
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.draft_proposer import DraftModelProposer, load_draft_model
from jpaged.utils import release_free_host_memory


@dataclasses.dataclass
class EngineParts:
    """What `LLMEngine` runs on."""

    mesh: object
    dtype: object            # weights and activations
    kv_cache_dtype: object   # KV pages (8-bit ones carry scales)
    attention_backend: str   # "pallas" | "xla"
    model_config: object
    tokenizer: object
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_blocks: int
    kv_bytes_per_block: int  # per device, every layer (and a draft model's) together
    max_model_len_note: str  # why max_model_len is below the model's, or ""
    kv_layout: KVCacheLayout  # the KV-cache groups: which table and pool tensor each layer uses
    kv_cache: object         # KVCacheManager (HybridKVCacheManager for several groups), or a baseline
    scheduler: Scheduler
    runner: ModelRunner
    lora: object = None      # the LoRAManager with enable_lora


MIN_CACHED_COMPILE_SECONDS = 0.05  # JAX's default (1 s) would leave most CPU executables out of the cache
JAX_DEFAULT_MIN_COMPILE_SECONDS = 1.0


def host_key() -> str:
    """What a compiled executable depends on beyond its program: jaxlib's version and the host's
    processor (model and feature flags). XLA:CPU compiles for the processor it runs on, and JAX's
    cache key knows neither, so a home directory shared by machines of different processors (NFS,
    a CI cache carried from machine to machine) must not share cached executables."""
    text = "\n".join([jax.lib.__version__, os.uname().machine, cpu_id()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_compilation_cache_dir() -> str:
    """``~/.cache/jpaged/jax/<host_key>``."""
    return os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "jax", host_key())


def enable_compilation_cache(path: str | None) -> None:
    """JAX's persistent compilation cache, so a second start compiles nothing: its directory (a
    process-wide JAX setting, left alone when the application set one, e.g. with
    ``JAX_COMPILATION_CACHE_DIR``; by default one per `host_key`) and the shortest compile it keeps,
    unless the application set that (``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``). It must be set
    before the process's first compile: JAX decides once whether a process uses the cache."""
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", path or default_compilation_cache_dir())
    if ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
            and jax.config.jax_persistent_cache_min_compile_time_secs == JAX_DEFAULT_MIN_COMPILE_SECONDS):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_SECONDS)


def resolve_dtypes(config: EngineConfig, platform: str) -> tuple[object, object]:
    """(model dtype, KV page dtype) on ``platform``: bfloat16 on TPU/GPU, float32 on the CPU,
    unless set."""
    dtype = DTYPES[config.dtype] if config.dtype != "auto" else (jnp.float32 if platform == "cpu" else jnp.bfloat16)
    kv_name = config.cache.kv_cache_dtype
    return dtype, dtype if kv_name == "auto" else pallas_kernels.KV_DTYPES[kv_name]


def resolve_platform(config: EngineConfig, mesh) -> tuple[object, str, object]:
    """(model dtype, attention backend, KV page dtype) for the mesh's platform."""
    device = mesh.devices.flat[0]
    platform = device.platform
    backend = resolve_backend(config.attention_backend, platform)
    check_kv_cache_dtype(config.cache.kv_cache_dtype, backend, platform, getattr(device, "compute_capability", None))
    dtype, kv_dtype = resolve_dtypes(config, platform)
    return dtype, backend, kv_dtype


def load(config: EngineConfig, model, tokenizer, *, dtype, backend: str, mesh):
    """The model to serve and its tokenizer: loaded from ``config.model`` (default: the embedded
    GGUF), or the in-memory ``model`` as it is."""
    if model is not None:
        if config.enable_expert_parallel != getattr(model, "expert_parallel", False):
            raise ValueError(f"enable_expert_parallel={config.enable_expert_parallel}: an in-memory model is served "
                             "as built (build a mixture-of-experts model with expert_parallel=True for it)")
        if config.quantization is not None:
            raise ValueError(f"quantization={config.quantization!r}: applies to a model loaded by path; "
                             "an in-memory model is served with its parameters as they are")
        c, tp = model.config, config.tensor_parallel_size
        if sharding.kv_head_replication(c.num_heads, c.num_kv_heads, tp) != 1:
            raise ValueError(f"tensor_parallel_size={tp}: an in-memory model with {c.num_kv_heads} KV heads "
                             "cannot be split; load it by path to replicate KV heads")
        return model, tokenizer
    path = config.model
    if path is None:
        from jpaged.loading.gguf_loader import default_model_path
        path = default_model_path()
    with phase(f"loading {path}"):
        model, _, tokenizer = load_model(path, dtype=dtype, mesh=mesh, attention_backend=backend,
                                         quantization=config.quantization,
                                         expert_parallel=config.enable_expert_parallel)
    release_free_host_memory()
    return model, tokenizer


def device_kv_budget(cache: CacheConfig, mesh) -> int | None:
    """The bytes a device of the mesh leaves for the KV pool: its memory x ``memory_utilization``
    less what is in use (the weights, once loaded); None when the device reports no memory (CPU).
    Each process can only read its own devices, so with several processes (one engine across
    hosts) each reads its first device and all take the smallest budget: every process must size
    the same pool."""
    local = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    stats = local.memory_stats() or {}
    budget = (int(stats["bytes_limit"] * cache.memory_utilization) - stats.get("bytes_in_use", 0)
              if "bytes_limit" in stats else None)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        unknown = np.iinfo(np.int64).max  # sent as its 8 bytes: without x64 JAX would narrow an int64
        mine = np.array([unknown if budget is None else budget], np.int64).view(np.uint8)
        budgets = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 8).copy().view(np.int64)
        budget = None if (budgets == unknown).any() else int(budgets.min())
    return budget


def num_kv_blocks(cache: CacheConfig, max_num_seqs: int, *, per_block: int, per_seq: int,
                  device_budget: int | None, state_bytes: int = 0) -> tuple[int, str, int | None]:
    """The KV pool's size in blocks, used by start-up and by the AOT tool alike: (blocks, where
    that came from, the byte budget or None). ``num_kv_blocks`` as set, else a byte budget:
    ``kv_cache_memory_bytes``, else ``device_budget`` (the device's memory at
    ``memory_utilization`` less what is in use and, ahead of time, the step's temporaries), else on
    the CPU (``device_budget`` None) ``cpu_default_bytes``, less ``state_bytes`` (the recurrent-state
    pools of a model with recurrent layers); never more than ``max_num_seqs`` sequences of
    ``per_seq`` blocks each use. 0 when the budget holds no block of ``per_block`` bytes (start-up
    refuses that; the AOT tool reports it)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks, "num_kv_blocks", None
    if cache.kv_cache_memory_bytes is not None:
        budget, source = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif device_budget is not None:
        budget, source = device_budget, f"memory_utilization={cache.memory_utilization}"
    else:  # CPU: devices report no memory
        budget, source = cache.cpu_default_bytes, "the CPU default"
    budget -= state_bytes
    if state_bytes:
        source += " less the recurrent-state pools"
    return int(max(0, min(budget // per_block, max_num_seqs * per_seq))), source, budget


def recurrent_model_config(config: EngineConfig) -> EngineConfig:
    """The settings a model with recurrent layers (`jpaged.core.recurrent_state`) runs with: prefix
    caching off and preemption by recompute (each with a log line when it was on), refusing what
    needs either (prefix-cache tiers) or takes tokens back (speculative decoding: a recurrent
    state cannot forget rejected proposals)."""
    cc = config.cache
    if config.speculative_config is not None:
        raise ValueError("speculative_config: not supported for a model with recurrent (linear-attention) layers: "
                         "their state cannot take back rejected proposals")
    if cc.kv_offload is not None:
        raise ValueError("kv_offload: keeps prefix-cache blocks, but prefix caching is off for a model with "
                         "recurrent (linear-attention) layers")
    if cc.allocator != "paged":
        raise ValueError(f"allocator={cc.allocator!r}: a model with recurrent (linear-attention) layers runs on the "
                         "paged allocator only")
    if cc.enable_prefix_caching:
        logger.info("prefix caching is off for this model: its linear-attention layers keep a recurrent state per "
                    "sequence, which KV blocks alone cannot restore")
    if cc.preemption_mode == "swap":
        logger.info("preemption_mode='swap': this model's recurrent states are not swapped; preempted requests "
                    "are recomputed")
    return dataclasses.replace(config, cache=dataclasses.replace(cc, enable_prefix_caching=False,
                                                                 preemption_mode="recompute"))


def fit_max_model_len(config: EngineConfig, max_model_len: int, num_blocks: int, source: str, per_block: int,
                      layout: KVCacheLayout) -> tuple[int, str]:
    """(max_model_len, why it is below the model's or "") so that one sequence of max_model_len fits the
    pool. Unset by the user: the model's, capped to what the pool holds (logged once). Set larger
    than a pool sized from a byte budget holds: ValueError naming both numbers (as vLLM does at start).
    A pool the user sized with ``num_kv_blocks`` is taken as given: a request longer than it is
    refused on its own (tests and benchmarks run tight pools on purpose)."""
    cc, sc = config.cache, config.scheduler
    fits = layout.max_tokens_per_seq(num_blocks, cc.block_size, sc.max_num_batched_tokens, max_model_len)
    if fits >= max_model_len:
        return max_model_len, ""
    pool = f"the KV pool holds {num_blocks} blocks of {cc.block_size} tokens"
    if fits < 2:
        raise ValueError(f"num_kv_blocks={num_blocks}: too small for one sequence of 2 tokens ({source}); "
                         f"{pool} and a sequence needs {layout.max_blocks_per_seq(2, cc.block_size, 1)}")
    if sc.max_model_len is None:
        logger.info("max_model_len capped from %d to %d: %s; set kv_cache_memory_bytes/num_kv_blocks to raise it",
                    max_model_len, fits, pool)
        return fits, (f"capped from the model's {max_model_len} because {pool}; "
                      "set num_kv_blocks/kv_cache_memory_bytes to raise it")
    if cc.num_kv_blocks is None:
        need = layout.max_blocks_per_seq(max_model_len, cc.block_size, sc.max_num_batched_tokens)
        raise ValueError(f"max_model_len={max_model_len}: one sequence of it needs {need} KV blocks of "
                         f"{cc.block_size} tokens ({need * per_block} bytes), but the pool ({source}) holds "
                         f"{num_blocks} ({num_blocks * per_block} bytes); lower max_model_len to <= {fits} or "
                         f"set kv_cache_memory_bytes >= {need * per_block} (or num_kv_blocks >= {need})")
    return max_model_len, ""


def kv_cache_manager(config: EngineConfig, num_blocks: int, max_model_len: int, layout: KVCacheLayout | None = None):
    cc = config.cache
    layout = layout or kv_cache_layout([None])
    if cc.allocator == "paged" and layout.num_groups > 1:
        return HybridKVCacheManager(layout, num_blocks, cc.block_size, cc.enable_prefix_caching, cc.share_forked_blocks)
    if cc.allocator == "paged":
        return KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, cc.share_forked_blocks,
                              sliding_window=layout.group_windows[0])
    if layout.num_groups > 1:
        raise ValueError(f"allocator={cc.allocator!r}: the reservation baselines keep one block table per "
                         "sequence; this model's layers need several (sliding-window and global layers)")
    from jpaged.core.reservation import ReservationKVCacheManager  # the paper's baselines
    return ReservationKVCacheManager(num_blocks, cc.block_size, mode=cc.allocator, max_model_len=max_model_len)


def _weights_digest(path, model) -> str:
    """The disk tier's name for a model's weights: its checkpoint's files, else its parameter bytes."""
    if isinstance(path, str) and os.path.exists(path):
        return "files:" + kv_namespace.checkpoint_digest(path)
    return "params:" + kv_namespace.params_digest(jax.tree.leaves(nnx.state(model)))


def _draft_descriptor(spec, draft, tensor_parallel_size: int) -> dict:
    """What the draft model's pages in a tier entry depend on: its weights and KV shape."""
    path = None
    if isinstance(spec.model, str):
        from jpaged.loading import presets
        path, _ = presets.resolve(spec.model, {})
        if path is None:
            from jpaged.loading.gguf_loader import default_model_path
            path = default_model_path()
    c = draft.config
    return {"weights": _weights_digest(path, draft), "layers": c.num_layers, "head_dim": c.head_dim,
            "kv_heads_per_device": max(1, c.num_kv_heads // tensor_parallel_size)}


def kv_offload_connector(config: EngineConfig, model, *, in_memory: bool, dtype, kv_dtype,
                         layout: KVCacheLayout, draft=None) -> KVOffload:
    """The prefix-cache tiers of ``config.cache.kv_offload``, the disk tier in a namespace of this
    model's weights and KV layout (`jpaged.core.kv_offload.namespace`), and of the draft model's
    (whose pages a tier entry carries too)."""
    cc, mc = config.cache, model.config
    path = config.model
    if path is None and not in_memory:
        from jpaged.loading.gguf_loader import default_model_path
        path = default_model_path()
    weights = _weights_digest(None if in_memory else path, model)
    extra = {} if draft is None else {
        "draft": _draft_descriptor(config.speculative_config, draft, config.tensor_parallel_size)}
    name = kv_namespace.namespace(
        weights, dtype=jnp.dtype(dtype).name, kv_dtype=jnp.dtype(kv_dtype).name, block_size=cc.block_size,
        group_windows=list(layout.group_windows), layers=[list(x) for x in layout.layers],
        num_tensors=layout.num_tensors, head_dim=mc.head_dim,
        kv_heads_per_device=max(1, mc.num_kv_heads // config.tensor_parallel_size),
        quantization=config.quantization, **extra)
    o = cc.kv_offload
    logger.info("kv_offload: host tier %.1f MiB, disk tier %s", o.host_bytes / 2**20,
                f"{o.disk_bytes / 2**20:.1f} MiB in {os.path.join(o.disk_path, name)}" if o.disk_path else "off")
    return KVOffload(host_bytes=o.host_bytes, disk_path=o.disk_path, disk_bytes=o.disk_bytes, namespace=name,
                     block_size=cc.block_size)


CPU_DECODE_WINDOW = 8  # decode steps per window on the CPU by default (docs/cpu.md: what they gain)


def with_decode_window(config: EngineConfig, platform: str) -> EngineConfig:
    """``config`` with ``num_scheduler_steps`` resolved: an unset one is `CPU_DECODE_WINDOW` on the
    CPU (where a window saves a step's host work and its split into pieces: ~1.2x on batches)
    unless speculative decoding is on (the two do not combine), else 1 (TPU/GPU: not measured)."""
    if config.scheduler.num_scheduler_steps is not None:
        return config
    steps = CPU_DECODE_WINDOW if platform == "cpu" and config.speculative_config is None else 1
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, num_scheduler_steps=steps))


def build(config: EngineConfig, model=None, tokenizer=None, devices=None) -> EngineParts:
    """Every part of an engine, its step shapes compiled (all of them with ``precompile``)."""
    mesh = sharding.make_mesh(config.tensor_parallel_size, devices)
    in_memory = model is not None
    enable_compilation_cache(config.compilation_cache_dir)
    dtype, backend, kv_dtype = resolve_platform(config, mesh)
    model, tokenizer = load(config, model, tokenizer, dtype=dtype, backend=backend, mesh=mesh)
    config = with_decode_window(config, mesh.devices.flat[0].platform)
    mc, sc, cc = model.config, config.scheduler, config.cache
    if sc.max_model_len is not None and sc.max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={sc.max_model_len}: exceeds the model's "
                         f"max_position_embeddings={mc.max_position_embeddings}")
    max_model_len = sc.max_model_len or mc.max_position_embeddings
    eos = tuple(mc.eos_token_ids) or (
        (tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ())
    spec = config.speculative_config
    draft = None
    if spec is not None and spec.method == "draft_model":
        draft = load_draft_model(spec, mc, dtype=dtype, attention_backend=backend, mesh=mesh,
                                 max_model_len=max_model_len)
    lora = None
    if config.enable_lora:  # the model's slot stacks, before the runner places its state
        from jpaged.lora.manager import LoRAManager
        from jpaged.models.lora import delta_form_for
        lora = LoRAManager(model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                           max_cpu_loras=config.max_cpu_loras, dtype=dtype,
                           delta=delta_form_for(mesh.devices.flat[0].platform))
    layout = kv_cache_layout(attention_windows(model))
    state_arrays = recurrent_state_arrays(model)  # per recurrent layer (none for most models)
    if state_arrays:
        config = recurrent_model_config(config)
        cc = config.cache
    if draft is not None and layout.group_windows[0] is not None:
        raise ValueError(f"speculative_config (method='draft_model'): the draft model reads the block table of "
                         f"the target's first KV-cache group, whose sliding window ({layout.group_windows[0]} "
                         "tokens) releases blocks the draft still needs; use method='ngram' with this model")
    per_block = sum(kv_pool.bytes_per_block(num_layers=n, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                            block_size=cc.block_size, dtype=kv_dtype,
                                            tensor_parallel_size=config.tensor_parallel_size)
                    for c, n in [(mc, layout.num_tensors)] + ([(draft.config, draft.config.num_layers)]
                                                              if draft is not None else []))  # a draft's pool: same blocks
    per_seq = layout.max_blocks_per_seq(max_model_len, cc.block_size, sc.max_num_batched_tokens)
    per_slot = kv_pool.state_bytes_per_slot(state_arrays, config.tensor_parallel_size)
    num_blocks, source, budget = num_kv_blocks(cc, sc.max_num_seqs, per_block=per_block, per_seq=per_seq,
                                               device_budget=device_kv_budget(cc, mesh),
                                               state_bytes=sc.max_num_seqs * per_slot)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={budget}: too small for one KV block of {per_block} bytes")
    max_model_len, max_model_len_note = fit_max_model_len(config, max_model_len, num_blocks, source, per_block,
                                                          layout)
    kv_name = jnp.dtype(kv_dtype).name
    if pallas_kernels.quant.is_quantized(kv_dtype):
        kv_name += f" + {jnp.dtype(pallas_kernels.SCALE_DTYPE).name} scales"
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB per device (%s); %s, %d bytes per token "
                "per device; set num_kv_blocks or kv_cache_memory_bytes to change it", num_blocks, cc.block_size,
                num_blocks * cc.block_size, num_blocks * per_block / 2**20, source, kv_name,
                per_block // cc.block_size)
    if layout.num_groups > 1:
        logger.info("KV cache groups (sliding window per group, None: global): %s; %d layers per block",
                    list(layout.group_windows), layout.num_tensors)
    kv_cache = kv_cache_manager(config, num_blocks, max_model_len, layout)
    if state_arrays:  # a state slot per sequence that max_num_seqs lets run
        logger.info("recurrent state: %d layers, %d slots x %.2f MiB per device = %.1f MiB", len(state_arrays),
                    sc.max_num_seqs, per_slot / 2**20, sc.max_num_seqs * per_slot / 2**20)
        kv_cache = RecurrentStateCache(kv_cache, sc.max_num_seqs)
    offload = None
    if cc.kv_offload is not None:
        offload = kv_offload_connector(config, model, in_memory=in_memory, dtype=dtype, kv_dtype=kv_dtype, layout=layout,
                                       draft=draft)
        kv_cache.pool.offload = offload
    swap_blocks = cc.swap_space_bytes // per_block if cc.preemption_mode == "swap" else 0
    scheduler = Scheduler(sc, kv_cache, max_model_len=max_model_len, preemption_mode=cc.preemption_mode,
                          swap_capacity_blocks=swap_blocks, seed=config.seed,
                          speculative_config=config.speculative_config,
                          lora_slots=None if lora is None else lora.slots)
    pool = kv_pool.KVPool(num_layers=layout.num_tensors, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                          num_blocks=num_blocks, block_size=cc.block_size, dtype=kv_dtype, mesh=mesh,
                          num_host_blocks=swap_blocks, counter=CompileCounter(), state_arrays=state_arrays,
                          num_state_slots=sc.max_num_seqs if state_arrays else 0)
    drafter = None
    if draft is not None:
        dc = draft.config
        draft_pool = kv_pool.KVPool(num_layers=dc.num_layers, num_kv_heads=dc.num_kv_heads, head_dim=dc.head_dim,
                                    num_blocks=num_blocks, block_size=cc.block_size, dtype=kv_dtype, mesh=mesh,
                                    num_host_blocks=swap_blocks, counter=pool.counter)
        drafter = DraftModelProposer(draft, draft_pool, mesh=mesh, num_speculative_tokens=spec.num_speculative_tokens,
                                     attention_backend=backend)
    buckets = StepBuckets(sc.max_num_seqs, max_model_len, cc.block_size, backend,
                          num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
                          num_kv_groups=layout.num_groups)
    platform = mesh.devices.flat[0].platform
    # a model given in memory (LLM.from_model) is the caller's: no attributes added to it
    packed = config.cpu_packed_weights and platform == "cpu" and mesh.devices.size == 1 and not in_memory \
        and cpu_kernels_available()
    runner = ModelRunner(model, pool, buckets, mesh=mesh, dtype=dtype, max_decode_window=sc.num_scheduler_steps,
                         whole_step=platform in ("tpu", "gpu"), drafter=drafter,
                         kv_layout=layout, kv_offload=offload,
                         processed_logprobs=config.logprobs_mode == "processed_logprobs", lora=lora,
                         weights_shared=in_memory, packed_weights_for_cpu=packed)
    if runner.packed_bytes:
        logger.info("packed copies of the projections for the C++ matmul: %.1f MiB (cpu_packed_weights=False "
                    "saves them)", runner.packed_bytes / 2**20)
    with phase("warm-up (compiling the step shapes)"):
        precompile.warm_up(runner, max_tokens=sc.max_num_batched_tokens, max_seqs=sc.max_num_seqs,
                           precompile=config.precompile, decode_windows=sc.num_scheduler_steps > 1)
    return EngineParts(mesh=mesh, dtype=dtype, kv_cache_dtype=kv_dtype, attention_backend=backend, model_config=mc,
                       tokenizer=tokenizer, max_model_len=max_model_len, eos_token_ids=eos, num_blocks=num_blocks,
                       kv_bytes_per_block=per_block, max_model_len_note=max_model_len_note,
                       kv_layout=layout, kv_cache=kv_cache, scheduler=scheduler, runner=runner, lora=lora)
