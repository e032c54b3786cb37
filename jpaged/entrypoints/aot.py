"""An engine's steps compiled ahead of time for a TPU or GPU target, without weights or a device.

`compile_engine` does for a target what start-up does on one (`startup.build`), abstractly: the
model's parameters as ``jax.ShapeDtypeStruct`` placed by the real sharding rules on a mesh of the
target's devices (KV heads repeated when tensor parallelism exceeds them, as loading does), the KV
pool sized by start-up's own function (`startup.num_kv_blocks`: ``num_kv_blocks``, else
``kv_cache_memory_bytes``, else ``memory_utilization`` of the chip's memory less the weights and the
largest step's temporaries), then every step of the warm-up plan (`runner.precompile.step_plan` on
the whole-step path, the code the engine runs on TPU/GPU: one jitted function per step, the pool donated; with
prefix-cache tiers, their block gather and scatter too) through
``jax.jit(...).trace(...).lower().compile()``. The compilers are the real ones (libtpu's Mosaic and
XLA TPU; XLA GPU, Triton and ptxas), run from a CPU host (`pallas_kernels.aot`). A compile proves
that the step compiles and fits, never a speed.
"""
import dataclasses
import time

import jax
import numpy as np
from flax import nnx

import pallas_kernels
from jpaged import sharding
from jpaged.config import EngineConfig
from jpaged.engine.startup import num_kv_blocks, recurrent_model_config, resolve_dtypes
from jpaged.entrypoints import roofline
from jpaged.loading.model_loader import abstract_model, kv_replicated_config
from jpaged.models import ModelConfig
from jpaged.core.kv_cache_layout import KVCacheLayout, kv_cache_layout
from jpaged.config import check_kv_cache_dtype
from jpaged.models.attention import (attention_windows, make_attention_metadata, recurrent_state_arrays,
                                     resolve_backend)
from jpaged.runner import kv_pool
from jpaged.runner.buckets import StepBuckets
from jpaged.runner.inputs import prepare_inputs
from jpaged.runner.model_runner import jit_whole_step
from jpaged.runner.precompile import step_plan
from jpaged.sample.sampler import sampling_tensors
from pallas_kernels.aot import targets as aot_targets
from pallas_kernels.aot.compile import captured_stderr, parse_spills

GiB = 1 << 30
TPU_HBM = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}  # per chip
MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                 "temp_size_in_bytes", "generated_code_size_in_bytes")


@dataclasses.dataclass
class StepCompile:
    """One step shape: its name (tokens, sampled rows, sampling, decode-only), the outcome, the
    compiler's memory figures per chip (bytes) and ptxas register spills (GPU)."""

    name: str
    ok: bool
    error: str = ""
    seconds: float = 0.0
    memory: dict = dataclasses.field(default_factory=dict)
    spills: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EngineCompile:
    """The figures of `compile_engine`, per chip unless said."""

    target: str
    num_devices: int
    hbm_bytes: int
    weight_bytes: int
    kv_bytes_per_block: int
    num_blocks: int
    kv_pool_bytes: int
    max_temp_bytes: int
    generated_code_bytes: int
    max_batch_at_max_model_len: int
    compile_seconds: float
    steps: list[StepCompile]
    state_pool_bytes: int = 0  # the recurrent-state pools of a model with linear-attention layers
    roofline: dict = dataclasses.field(default_factory=dict)  # `roofline.estimate`: an estimate, not a measurement
    attention_backend: str = "pallas"  # the backend compiled ("auto" on TPU/GPU: the Pallas kernels)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    def pool_note(self, max_num_seqs: int) -> str:
        """A line for the summary when fewer sequences of max_model_len fit the pool than
        ``max_num_seqs`` asks to run ("" when they all fit)."""
        fit = self.max_batch_at_max_model_len
        if fit >= max_num_seqs:
            return ""
        return (f"\nnote: max_num_seqs={max_num_seqs} but only {fit} sequences of max_model_len fit in the pool "
                f"({self.num_blocks} blocks): batches of long sequences preempt; lower max_num_seqs or "
                "max_model_len, or give the pool more (memory_utilization, num_kv_blocks)")

    @property
    def fits(self) -> bool:
        return (self.weight_bytes + self.kv_pool_bytes + self.state_pool_bytes + self.max_temp_bytes
                + self.generated_code_bytes <= self.hbm_bytes)


def target_mesh(target: str, tensor_parallel_size: int, topology: str | None = None):
    """(mesh of ``tensor_parallel_size`` abstract devices, memory per chip in bytes) of ``target``
    (a name of `pallas_kernels.aot.targets.TARGETS`); ``topology``: a TPU slice (``"v5e:2x4"``,
    ``"v6e:4x4"``: four hosts) to take the devices from, instead of the target's 2x2."""
    from jax.experimental import topologies

    t = aot_targets.get(target)
    if t.platform == "tpu":
        topo = topologies.get_topology_desc(topology_name=topology or t.topology, platform="tpu")
        hbm = TPU_HBM[t.name]
    else:
        config = aot_targets.gpu_target_config(target)
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{tensor_parallel_size}",
                                            target_config=config)
        hbm = int(config.split("device_memory_size:")[1].split()[0])
    if len(topo.devices) < tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: the topology has {len(topo.devices)} chips")
    return sharding.make_mesh(tensor_parallel_size, topo.devices), hbm


def is_stacked_expert(names: tuple) -> bool:
    """Whether a parameter (its path names) is a stacked expert weight ``[E, ...]`` of an MoE layer."""
    names = [n for n in names if isinstance(n, str)]
    return len(names) > 1 and names[-2] == "experts" and names[-1] in sharding.EXPERT_LEAVES


def deployment_roofline(state, mc: ModelConfig, layout: KVCacheLayout, target: str, *, per_block: int,
                        block_size: int, tp: int, num_blocks: int, max_num_seqs: int, max_batched_tokens: int,
                        max_model_len: int, steps: list, state_bytes_per_seq: int = 0) -> dict:
    """`roofline.estimate` of the compiled deployment: its decode-only step shapes, and the
    workload at as many requests as the pool and ``max_num_seqs`` hold at once."""
    leaves = [(sharding.key_path_names(path), x.sharding.shard_shape(x.shape), x.dtype.itemsize)
              for path, x in jax.tree_util.tree_leaves_with_path(state)]
    cost = roofline.step_cost(leaves, config=mc, layout=layout, kv_bytes_per_block=per_block, block_size=block_size,
                              tensor_parallel_size=tp, is_expert=is_stacked_expert,
                              state_bytes_per_seq=state_bytes_per_seq)
    prompt_tokens, output_tokens = roofline.WORKLOAD
    per_request = layout.max_blocks_per_seq(prompt_tokens + output_tokens, block_size, max_batched_tokens)
    rows = sorted({int(s.name.split("rows=")[1].split()[0]) for s in steps if s.name.endswith("decode-only")})
    return roofline.estimate(cost, aot_targets.get(target), decode_rows=rows,
                             fit_batch=min(max_num_seqs, num_blocks // per_request),
                             max_batched_tokens=max_batched_tokens, max_model_len=max_model_len)


def _placed(tree, sharding_of):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding_of(x)), tree)


def abstract_state(config: ModelConfig, mesh, *, dtype, quantization: str | None, expert_parallel: bool = False,
                   lora: tuple[int, int] | None = None, attention_backend: str = "pallas"):
    """(graphdef, state, KV-cache layout): the model's parameters as structs placed by
    `sharding.param_format`, and its layers' KV-cache groups. ``lora``: (adapter slots incl. slot
    0, max rank) of the LoRA slot stacks to attach (`jpaged.models.lora.attach_lora`)."""
    model = abstract_model(config, dtype=dtype, attention_backend=attention_backend, quantization=quantization,
                           expert_parallel=expert_parallel)
    if lora is not None:
        from jpaged.models.lora import attach_lora
        attach_lora(model, *lora, dtype, abstract=True)
    layout = kv_cache_layout(attention_windows(model))
    graphdef, state = nnx.split(model)

    def place(key_path, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.param_format(
            sharding.key_path_names(key_path), x.shape, mesh, expert_parallel))

    return graphdef, jax.tree_util.tree_map_with_path(place, state), layout


def abstract_caches(config: ModelConfig, mesh, *, num_tensors: int, num_blocks: int, block_size: int, kv_dtype,
                    state_arrays=(), num_state_slots: int = 0):
    """The pool as the engine makes it (`kv_pool.KVPool`): the KV tensors, then the recurrent-state
    pools of ``state_arrays`` (per recurrent layer), as placed structs."""
    specs = pallas_kernels.pool.layer_arrays(config.num_kv_heads, num_blocks, block_size, config.head_dim, kv_dtype)
    layer = tuple(jax.ShapeDtypeStruct(shape, dt, sharding=sharding.kv_pool_format(mesh, len(shape)))
                  for shape, dt in specs)
    states = [tuple(jax.ShapeDtypeStruct((num_state_slots,) + a.shape, a.dtype, sharding=sharding.state_pool_sharding(
        mesh, (num_state_slots,) + a.shape, a.head_axis)) for a in arrays) for arrays in state_arrays]
    return [layer] * num_tensors + states


def step_arguments(step, buckets: StepBuckets, mesh, layout: KVCacheLayout, processed_logprobs: bool = False,
                   num_lora_slots: int = 0):
    """The step's inputs as the runner builds them (`prepare_inputs`, the metadata of the buckets'
    attention backend with every KV-cache group's tables and the LoRA slots, the padded sampling
    tensors of the engine's ``logprobs_mode``), as replicated structs."""
    inputs = prepare_inputs(step, buckets, layout.num_groups, num_lora_slots, recurrent=layout.num_recurrent > 0)
    md = make_attention_metadata(buckets.attention_backend, positions=inputs.positions,
                                 slot_mapping=inputs.slot_mapping, query_start_loc=inputs.query_start_loc,
                                 seq_lens=inputs.seq_lens,
                                 block_tables=inputs.block_tables, num_seqs=inputs.num_seqs,
                                 group_slot_mappings=inputs.group_slot_mappings,
                                 group_block_tables=inputs.group_block_tables,
                                 kv_layout=None if layout.is_trivial else layout.layers, lora=inputs.lora,
                                 state_slots=inputs.state_slots)
    args = (inputs.input_ids, md, inputs.logits_indices, None,
            sampling_tensors(step.sampling, inputs.num_rows, processed_logprobs))
    return _placed(args, lambda _: sharding.replicated(mesh))


def step_name(step) -> str:
    tokens = step.num_tokens
    if any(s.spec_token_ids for s in step.seqs):
        decode = " verification"
    else:
        decode = " decode-only" if all(len(s.token_ids) == 1 for s in step.seqs) else ""
    sampling = "greedy" if step.sampling.all_greedy else "sampled"
    return f"tokens={tokens} rows={len(step.sample_rows)} {sampling}{decode}"


def compile_step(fn, state, caches, args, device, name: str) -> StepCompile:
    return compile_traced(lambda: fn.trace(state, caches, *args), device, name)


def compile_transfers(mesh, caches, num_blocks: int, device) -> list[StepCompile]:
    """The prefix-cache tiers' block moves (`kv_pool.KVPool.compile_transfers`): the gather and the
    scatter of every padded block count."""
    gather, scatter = kv_pool.jit_transfers(mesh, [tuple(x.format for x in layer) for layer in caches])
    results = []
    for n in kv_pool.transfer_buckets(num_blocks):
        ids = jax.ShapeDtypeStruct((n,), np.int32, sharding=sharding.replicated(mesh))
        data = _placed(jax.eval_shape(kv_pool._gather_blocks, caches, ids), lambda _: sharding.replicated(mesh))
        results.append(compile_traced(lambda: gather.trace(caches, ids), device, f"kv_offload gather blocks={n}"))
        results.append(compile_traced(lambda: scatter.trace(caches, ids, data), device,
                                      f"kv_offload scatter blocks={n}"))
    return results


def compile_traced(trace, device, name: str) -> StepCompile:
    """Compiles what ``trace()`` traces, with the compiler's figures (errors are a result)."""
    start = time.perf_counter()
    # the target's device is the default one, so lowering rules that query the chip (Pallas TPU
    # asks its generation) see the target, not this host
    with captured_stderr() as log, jax.default_device(device):
        try:
            compiled = trace().lower().compile()
            error = None
        except Exception as e:  # noqa: BLE001 -- every compiler error is a result here
            error = e
    seconds = time.perf_counter() - start
    spills = parse_spills(log[0])
    if error is not None:
        lines = [line for line in str(error).splitlines() if line.strip()]
        return StepCompile(name, False, "\n".join(lines[:6]), seconds, spills=spills)
    analysis = compiled.memory_analysis()
    memory = {f: int(getattr(analysis, f)) for f in MEMORY_FIELDS if hasattr(analysis, f)}
    return StepCompile(name, True, "", seconds, memory, spills)


def edges(plan: list) -> list:
    """The steps of ``plan`` at the ends of each kind (fewest and most tokens; greedy and sampled;
    mixed and decode-only): a cross-section that compiles in a fraction of the time."""
    kinds: dict = {}
    for step in plan:
        kinds.setdefault(step_name(step).split(" ", 2)[2], []).append(step)
    picked = [s for steps in kinds.values() for s in (steps[0], steps[-1])]
    return [s for s in plan if any(s is p for p in picked)]


def largest(plan: list) -> list:
    """The sampled step with the most tokens and the sampled decode-only step with the most rows:
    the shapes with the largest temporaries, which decide what fits."""
    kinds: dict = {}
    for step in plan:
        name = step_name(step)
        if "sampled" in name:
            kinds[name.endswith("decode-only")] = step
    return [s for s in plan if any(s is p for p in kinds.values())]


PLANS = {"all": lambda plan: plan, "edges": edges, "largest": largest}


def compile_engine(model_config: ModelConfig, config: EngineConfig, target: str, *, topology: str | None = None,
                   shapes: str = "all", progress=None, on_plan=None) -> EngineCompile:
    """Compiles the step shapes of ``config`` (the engine settings) for ``target``: ``shapes`` "all"
    (the warm-up plan), "edges" (`edges`) or "largest" (`largest`). ``on_plan(num_steps)``
    (optional) is called once the plan is known, before the first compile (the probe of the largest
    step, which sizes the pool and is not reported); ``progress(step_compile)`` after each step of
    the plan."""
    start = time.perf_counter()
    sc, cc, tp = config.scheduler, config.cache, config.tensor_parallel_size
    mesh, hbm = target_mesh(target, tp, topology)
    device = mesh.devices.flat[0]
    dtype, kv_dtype = resolve_dtypes(config, device.platform)
    # the backend start-up picks for the chip ("auto": the Pallas kernels; "xla": the jnp loops)
    backend = resolve_backend(config.attention_backend, device.platform)
    check_kv_cache_dtype(config.cache.kv_cache_dtype, backend, device.platform,
                         getattr(device, "compute_capability", None))
    mc, _ = kv_replicated_config(model_config, tp)
    max_model_len = sc.max_model_len or mc.max_position_embeddings
    num_lora_slots = config.max_loras + 1 if config.enable_lora else 0
    graphdef, state, layout = abstract_state(mc, mesh, dtype=dtype, quantization=config.quantization,
                                             expert_parallel=config.enable_expert_parallel, attention_backend=backend,
                                             lora=(num_lora_slots, config.max_lora_rank) if num_lora_slots else None)
    weight_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                       for x in jax.tree.leaves(state))
    state_arrays = recurrent_state_arrays(nnx.merge(graphdef, state))  # per recurrent layer (most models: none)
    if state_arrays:
        config = recurrent_model_config(config)
        cc = config.cache
    per_slot = kv_pool.state_bytes_per_slot(state_arrays, tp)
    num_state_slots = sc.max_num_seqs if state_arrays else 0
    per_block = kv_pool.bytes_per_block(num_layers=layout.num_tensors, num_kv_heads=mc.num_kv_heads,
                                        head_dim=mc.head_dim, block_size=cc.block_size, dtype=kv_dtype,
                                        tensor_parallel_size=tp)
    spec = config.speculative_config
    if spec is not None and spec.method != "ngram":
        raise ValueError(f"speculative_config (method={spec.method!r}): only 'ngram' compiles ahead of time here "
                         "(a draft model's own steps are not in the plan)")
    buckets = StepBuckets(sc.max_num_seqs, max_model_len, cc.block_size, backend, num_kv_groups=layout.num_groups,
                          num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens)
    plan = PLANS[shapes](step_plan(buckets, max_tokens=sc.max_num_batched_tokens, max_seqs=sc.max_num_seqs,
                                   whole_step=True))
    # the blocks one sequence of max_model_len holds (a windowed group: those its window reaches)
    per_seq = layout.max_blocks_per_seq(max_model_len, cc.block_size, sc.max_num_batched_tokens)
    with jax.set_mesh(mesh):
        def compile_all(num_blocks, steps, progress=None):
            caches = abstract_caches(mc, mesh, num_tensors=layout.num_tensors, num_blocks=num_blocks,
                                     block_size=cc.block_size, kv_dtype=kv_dtype, state_arrays=state_arrays,
                                     num_state_slots=num_state_slots)
            fn = jit_whole_step(graphdef, mesh, [tuple(x.format for x in layer) for layer in caches])
            processed = config.logprobs_mode == "processed_logprobs"
            results = []
            for step in steps:
                results.append(compile_step(fn, state, caches, step_arguments(step, buckets, mesh, layout, processed,
                                                                          num_lora_slots),
                                            device, step_name(step)))
                if progress is not None:
                    progress(results[-1])
            if cc.kv_offload is not None and steps is plan:
                for result in compile_transfers(mesh, caches[:layout.num_tensors], num_blocks, device):
                    results.append(result)
                    if progress is not None:
                        progress(result)
            return results

        if on_plan is not None:  # the tiers' moves of the largest pool the plan allows
            moves = kv_pool.transfer_buckets(cc.num_kv_blocks or sc.max_num_seqs * per_seq) if cc.kv_offload else []
            on_plan(len(plan) + 2 * len(moves))
        # the largest step with a small pool gives the temporaries; the pool gets what is left
        probe = compile_all(min(1024, sc.max_num_seqs * per_seq), [plan[-1]])[0]
        temps = probe.memory.get("temp_size_in_bytes", 0) + probe.memory.get("generated_code_size_in_bytes", 0)
        num_blocks, _, _ = num_kv_blocks(cc, sc.max_num_seqs, per_block=per_block, per_seq=per_seq,
                                         device_budget=int(hbm * cc.memory_utilization) - weight_bytes - temps,
                                         state_bytes=num_state_slots * per_slot)
        steps = compile_all(max(num_blocks, 1), plan, progress) if probe.ok else [probe]
    done = [s for s in steps if s.ok]
    return EngineCompile(
        target=topology or target, num_devices=tp, hbm_bytes=hbm, weight_bytes=weight_bytes,
        kv_bytes_per_block=per_block, num_blocks=num_blocks, kv_pool_bytes=num_blocks * per_block,
        max_temp_bytes=max((s.memory.get("temp_size_in_bytes", 0) for s in done), default=0),
        generated_code_bytes=max((s.memory.get("generated_code_size_in_bytes", 0) for s in done), default=0),
        max_batch_at_max_model_len=num_blocks // per_seq,
        compile_seconds=time.perf_counter() - start, steps=steps, state_pool_bytes=num_state_slots * per_slot,
        roofline=deployment_roofline(state, mc, layout, target, per_block=per_block, block_size=cc.block_size, tp=tp,
                                     num_blocks=num_blocks, max_num_seqs=sc.max_num_seqs,
                                     max_batched_tokens=sc.max_num_batched_tokens, max_model_len=max_model_len,
                                     steps=steps, state_bytes_per_seq=per_slot),
        attention_backend=backend)

