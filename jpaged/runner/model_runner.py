"""Host arrays -> padded static-shape batch -> jitted step -> sampled tokens.

``execute(scheduler_output)`` does a step's block moves (swaps, copy-on-write copies), pads the
step to its buckets (`buckets.StepBuckets`, `inputs.prepare_inputs`), runs the jitted step and
returns the sampled tokens. It reads only the output's plain data, never a request.

Two ways to run a step: on TPU/GPU (and for models without `LayerPieces`) one jitted function does
the forward, the logits and the sampler (one executable per step shape); on the CPU the model runs
piece by piece (embed, calls of up to six layers, rows, head, sampler), which keeps compiling a new
shape cheap. Each layer's KV pool is donated to its call, so XLA updates it in place.

KV-cache groups (`jpaged.core.kv_cache_layout`): the pool has a tensor per layer, or, for a model
whose layers attend with different windows, fewer tensors that layers of different groups share;
each layer reads its group's block table and slot mapping and its tensor (`kv_layout`). A
recurrent layer reads its state pool (after the tensors) at each sequence's state slot; the
step's state copies (forks) run with its block copies.
"""
import functools
import gc
import time

import jax
import numpy as np
from flax import nnx

from jpaged import sharding
from jpaged.core.kv_cache_layout import KVCacheLayout, kv_cache_layout
from jpaged.core.scheduler_output import SchedulerOutput, StepResult
from jpaged.loading.weight_update import WeightTargets, host_copies
from jpaged.models.attention import attention_backend_of, make_attention_metadata
from jpaged.runner import packed_weights
from jpaged.runner.background_compile import BackgroundCompiler
from jpaged.runner.buckets import StepBuckets
from jpaged.runner.decode_window import decode_window
from jpaged.runner.inputs import prepare_inputs
from jpaged.runner.kv_pool import KVPool
from jpaged.runner.layer_pieces import LayerPieces
from jpaged.sample.rejection_sampler import num_accepted
from jpaged.sample.sampler import (prompt_logprob_tensors, prompt_logprobs, sample, sampling_tensors)
from jpaged.sample.sampling_batch import SamplingBatch, per_row_values
from jpaged.sampling_params import SamplingParams


def _take_rows(x, indices):
    return x[indices]


def whole_step(graphdef, state, kv_caches, input_ids, md, logits_indices, prompt_lp, sampling):
    """A step in one function: forward, logits and sampler. Returns ((sampled tokens, logprobs, top
    ids, top logprobs), prompt-logprob results or None), kv_caches."""
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(input_ids, md.positions, kv_caches, md)
    prompt_out = None
    if prompt_lp is not None:
        prompt_out = prompt_logprobs(model.compute_logits(hidden[prompt_lp.indices]), prompt_lp)
    return (sample(model.compute_logits(hidden[logits_indices]), sampling), prompt_out), kv_caches


def whole_logits(graphdef, state, kv_caches, input_ids, md, logits_indices):
    """The sampled rows' logits from one whole forward: (logits [R, V], kv_caches)."""
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(input_ids, md.positions, kv_caches, md)
    return model.compute_logits(hidden[logits_indices]), kv_caches


def jit_whole_step(graphdef, mesh, pool_shardings):
    """`whole_step` jitted as the engine runs it: the pool donated, results replicated."""
    return jax.jit(functools.partial(whole_step, graphdef), donate_argnums=(1,),
                   out_shardings=(sharding.replicated(mesh), pool_shardings))


def jit_decode_window(logits_fn, mesh, pool_shardings, *, max_steps: int, block_size: int, vocab_size: int):
    """`decode_window.decode_window` of ``logits_fn`` jitted as the engine runs it."""
    window = functools.partial(decode_window, logits_fn, max_steps=max_steps, block_size=block_size,
                               vocab_size=vocab_size)
    return jax.jit(window, donate_argnums=(1,), out_shardings=(sharding.replicated(mesh), pool_shardings))


WINDOW_HOT_AFTER = 32  # decode steps of one batch shape before its window compiles (unless precompiled)


class ModelRunner:
    """Owns the device side: parameters, the KV pool, and the jitted functions that use them."""

    def __init__(self, model, kv_pool: KVPool, buckets: StepBuckets, *, mesh, dtype, max_decode_window: int = 1,
                 whole_step: bool = False, drafter=None, kv_layout: KVCacheLayout | None = None,
                 kv_offload=None, processed_logprobs: bool = False,
                 lora=None, weights_shared: bool = False, packed_weights_for_cpu: bool = False):
        """``dtype``: the model's activations. ``whole_step``: one jitted function per step
        (accelerators), else layer pieces where the model has them. ``max_decode_window``: the most
        decode steps one window runs. ``drafter``: a `DraftModelProposer` (speculative decoding
        with a draft model), run after each step. ``kv_layout``: the KV-cache groups (default: one
        group, a pool tensor per layer). ``kv_offload``: the prefix-cache tiers' `KVOffload`, which
        keeps the blocks a step stores. ``processed_logprobs``: logprobs of the distribution
        sampled from (``logprobs_mode="processed_logprobs"``), else the model's. ``lora``: the
        `LoRAManager` of a model served with adapters (its slot stacks attached), whose newly
        assigned slots each step writes first. ``weights_shared``: the model's buffers are the
        caller's too (``LLM.from_model``), so a weight update never donates them.
        ``packed_weights_for_cpu``: the projections get packed copies for the C++ CPU matmul
        (`jpaged.runner.packed_weights`), made again from the kernels whenever they change."""
        self.processed_logprobs = processed_logprobs
        self.config, self.dtype = model.config, dtype
        self.kv_offload = kv_offload
        self.lora = lora
        self.num_lora_slots = 0 if lora is None else lora.num_slots
        self.drafter = drafter
        self.kv_pool, self.buckets, self.mesh = kv_pool, buckets, mesh
        self.kv_layout = kv_layout or kv_cache_layout([None] * model.config.num_layers)
        self.counter = kv_pool.counter
        self.attention_backend = attention_backend_of(model)
        self.packed_bytes = packed_weights.attach(model) if packed_weights_for_cpu else 0
        graphdef, state = nnx.split(model)
        self.graphdef = graphdef
        self.state = sharding.shard_state(state, mesh, expert_parallel=getattr(model, "expert_parallel", False))
        self._lora_writer = None
        if lora is not None:  # compiled now (slot 0 rewritten with its zeros), not at the first adapter
            from jpaged.lora.device_slots import DeviceSlotWriter
            self._lora_writer = DeviceSlotWriter(self.state)
            leaves, treedef = jax.tree.flatten(self.state)
            self._lora_writer.prepare(leaves)
            self.state = jax.tree.unflatten(treedef, leaves)
        self.weight_targets = WeightTargets(graphdef, self.state, weights_shared)  # what `load_weights` must match
        self.sleeping_leaves: dict | None = None  # asleep: {path: host array} of the leaves kept
        replicated, pool = sharding.replicated(mesh), kv_pool.shardings()
        self._replicated = replicated
        self.pieces = None if whole_step else LayerPieces.of(nnx.merge(graphdef, self.state))  # a view
        if self.pieces is None:
            self._step = jit_whole_step(graphdef, mesh, pool)
        else:  # embed, one jit per layer structure and layout (shared by the layers), rows, head, sampler
            self._embed = jax.jit(self.pieces.embed)
            self._calls = [self._layer_call(*call) for call in self.pieces.calls]
            self._layers = {key: jax.jit(functools.partial(self.pieces.layer_fns[structure], layout),
                                         donate_argnums=(1,), out_shardings=(replicated, [pool[t] for t in tensors]))
                            for key, structure, _, _, tensors, layout in self._calls}
            self._layer_names = [f"layers{structure}x{count}" + ("" if self.kv_layout.is_trivial else str(layout))
                                 for structure, count, layout in self._layers]  # the compile counter's names
            self._take_rows = jax.jit(_take_rows)  # apart from the head: it alone depends on both counts
            self._head = jax.jit(self.pieces.head, out_shardings=replicated)
            self._sample = jax.jit(sample)
        self.window_compiler = BackgroundCompiler(mesh, hot_after=WINDOW_HOT_AFTER)
        self._window = jit_decode_window(self._logits, mesh, pool, max_steps=max_decode_window,
                                         block_size=buckets.block_size, vocab_size=self.config.vocab_size)

    @property
    def kv_pools(self) -> list[KVPool]:
        """The target's KV pool, and the draft model's."""
        return [self.kv_pool] + ([self.drafter.kv_pool] if self.drafter is not None else [])

    def _layer_call(self, structure: int, first: int, end: int):
        """(jit key, structure, first, end, pool tensors, layout) of a call of layers first..end-1:
        the tensors it updates, and each layer's (group, index among them)."""
        pairs = self.kv_layout.layers[first:end]
        tensors = tuple(dict.fromkeys(t for _, t in pairs))
        layout = tuple((g, tensors.index(t)) for g, t in pairs)
        return (structure, end - first, layout), structure, first, end, tensors, layout

    @property
    def num_compilations(self) -> int:
        """Distinct argument shapes the step's jitted pieces, the sampler and block moves have been
        called with: each is one compilation (or one load from the persistent compilation cache)."""
        return len(self.counter)

    # Weights and sleep ---------------------------------------------------------------------------------
    def current_leaves(self) -> dict | None:
        """{path: leaf} of the weights on the device (None asleep): an update may reuse their buffers."""
        return None if self.state is None else dict(zip(self.weight_targets.paths, jax.tree.leaves(self.state)))

    def load_weights(self, leaves: dict) -> None:
        """Serves new parameter arrays ({path: array}, already on the engine's shardings and dtypes,
        `WeightTargets.new_leaves`); the other leaves stay. Same shapes and shardings: the compiled
        step runs them as it is. Asleep, they wait for `wake_up`."""
        if self.sleeping_leaves is not None:
            self.sleeping_leaves.update(leaves)
            return
        flat = dict(zip(self.weight_targets.paths, jax.tree.leaves(self.state)))
        flat.update(leaves)
        self._set_state(self.weight_targets.state(self._packed(flat, changed=set(leaves))))

    def _packed(self, leaves: dict, changed=None) -> dict:
        """``leaves`` with the packed copies of the kernels in ``changed`` (None: all) made again
        (the copies this runner attached, or that a model given to it had already)."""
        paths = self.weight_targets.paths
        if not any(map(packed_weights.is_packed, paths)):
            return leaves
        return {p: x if x is leaves.get(p) else self.weight_targets.place(p, x, "packed weight")
                for p, x in packed_weights.refresh(leaves, paths, changed).items()}

    def _set_state(self, state) -> None:
        self.state = state
        if self.pieces is not None:  # the same jitted pieces, new leaves
            fresh = LayerPieces.of(nnx.merge(self.graphdef, state))
            self.pieces.shell_state, self.pieces.layer_leaves = fresh.shell_state, fresh.layer_leaves

    def sleep(self, level: int) -> None:
        """Frees the KV pools (and their host swap buffers) and the parameters' device buffers:
        level 1 keeps a host copy of every leaf, level 2 only of the non-parameter leaves (the next
        `load_weights` brings the parameters)."""
        targets = self.weight_targets  # packed copies are not kept: made again at wake-up
        keep = [p for p in targets.paths if (level == 1 or p not in targets.param_paths)
                and not packed_weights.is_packed(p)]
        flat = dict(zip(targets.paths, jax.tree.leaves(self.state)))
        self.sleeping_leaves = dict(zip(keep, host_copies([flat[p] for p in keep])))
        self.state = None
        if self.pieces is not None:
            self.pieces.shell_state, self.pieces.layer_leaves = None, None
        if self.drafter is not None:
            self.drafter.sleep()
        for pool in self.kv_pools:
            pool.caches, pool.host = None, None
        gc.collect()  # buffers held only by reference cycles (NNX modules) are freed now, not later

    def wake_up(self) -> None:
        """Puts the parameters back on their shardings and makes new (empty) KV pools."""
        targets, leaves = self.weight_targets, self.sleeping_leaves
        missing = [p for p in targets.paths if p not in leaves and not packed_weights.is_packed(p)]
        if missing:
            raise ValueError("wake_up: the weights were dropped by sleep(level=2); call update_weights(weights) "
                             f"first (missing e.g. {'.'.join(map(str, missing[0]))})")
        self._set_state(targets.state(self._packed(targets.place_all(leaves))))
        self.sleeping_leaves = None
        if self.drafter is not None:
            self.drafter.wake_up()
        for pool in self.kv_pools:
            pool.reset()

    # A step -------------------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> list[StepResult]:
        """Runs the step (``out.num_steps`` of them for a decode window): one result per step."""
        start = time.perf_counter()
        stored = [pool.read_blocks([b for b, _ in out.kv_stores]) for pool in self.kv_pools] if out.kv_stores else None
        for pool in self.kv_pools:  # a draft model's pool has the same block tables
            pool.swap_out(out.swap_out)  # before anything this step writes into the freed blocks
        if out.kv_loads:  # tier hits into free blocks, before the step reads them
            loading = time.perf_counter()
            self.write_tier_blocks(out.kv_loads)
            self.kv_offload.note_load_seconds(time.perf_counter() - loading)
        for pool in self.kv_pools:
            pool.swap_in(out.swap_in)
            pool.copy_blocks(out.block_copies)
        self.kv_pool.copy_states(out.state_copies)
        self.write_lora_slots(out.lora_loads)
        inputs = prepare_inputs(out, self.buckets, self.kv_layout.num_groups, self.num_lora_slots,
                                recurrent=self.kv_layout.num_recurrent > 0)
        md = make_attention_metadata(self.attention_backend, positions=inputs.positions,
                                     slot_mapping=inputs.slot_mapping, query_start_loc=inputs.query_start_loc,
                                     seq_lens=inputs.seq_lens, block_tables=inputs.block_tables,
                                     num_seqs=inputs.num_seqs, group_slot_mappings=inputs.group_slot_mappings,
                                     group_block_tables=inputs.group_block_tables, kv_layout=self._md_layout,
                                     lora=inputs.lora, state_slots=inputs.state_slots)
        sampling = sampling_tensors(out.sampling, inputs.num_rows, self.processed_logprobs)
        n = len(out.sample_rows)
        prepared = time.perf_counter()
        window = None
        if out.num_steps > 1:
            window_args = (self._params(), self.kv_pool.caches, inputs.input_ids, md, inputs.logits_indices,
                           sampling, np.int32(out.num_steps))
            window = self._ready_window(window_args)
        with jax.set_mesh(self.mesh):
            if window is not None:
                sampled, self.kv_pool.caches = window(*window_args)
                sampled = [np.asarray(a) for a in sampled]  # each [max steps, rows, ...]
                results = [StepResult(*(a[i, :n] for a in sampled)) for i in range(out.num_steps)]
            else:
                prompt_lp = prompt_logprob_tensors(out.prompt_logprob_rows, inputs.prompt_logprob_indices)
                sampled, prompt_out = self._run(inputs, md, sampling, prompt_lp)
                drafts = None if self.drafter is None else self.drafter.propose(out, inputs, md, sampled[0])
                results = [StepResult(*(np.asarray(a)[:n] for a in sampled),
                                      prompt_logprobs=None if prompt_out is None
                                      else tuple(np.asarray(a) for a in prompt_out))]
                results[0].num_accepted = num_accepted(out, results[0].tokens)
                if drafts is not None:
                    results[0].draft_token_ids = np.asarray(drafts)[:len(out.seqs)]
        results[0].prepare_seconds, results[0].device_seconds = prepared - start, time.perf_counter() - prepared
        if stored is not None:  # the copies ran beside the step; a block's arrays: the target's, then the draft's
            blocks = [sum(parts, ()) for parts in zip(*(read() for read in stored))]
            self.kv_offload.store([key for _, key in out.kv_stores], blocks)
        return results

    def _ready_window(self, args, now: bool = False):
        """The decode window's executable for ``args``, or None until it is compiled in the
        background (a window-planned step then runs as one single step)."""
        key = self.counter.signature("window", *args[2:])  # the parameters' and the pool's never change
        window = self.window_compiler.executable(key, self._window, args, now=now)
        if key in self.window_compiler:  # compiled, or compiling: one compilation (or cache load)
            self.counter.signatures.add(key)
        return window

    def write_tier_blocks(self, loads: list[tuple[int, tuple]]) -> None:
        """Tier blocks into the device pools: each block's arrays are the target pool's, then the
        draft model's (as `execute` stores them)."""
        start = 0
        for pool in self.kv_pools:
            n = len(pool.array_specs())
            pool.write_blocks([(block, arrays[start:start + n]) for block, arrays in loads])
            start += n

    def _run(self, inputs, md, sampling, prompt_lp):
        """(sampled tokens, logprobs, top ids, top logprobs), prompt-logprob results or None."""
        if self.pieces is None:
            (sampled, prompt_out), self.kv_pool.caches = self.counter.call(
                "step", self._step, self.state, self.kv_pool.caches, inputs.input_ids, md, inputs.logits_indices,
                prompt_lp, sampling, num_fixed=2)
            return sampled, prompt_out
        p = self.pieces
        md = jax.device_put(md, self._replicated)  # once, not once per layer
        x, extra = self.counter.call("embed", self._embed, p.shell_state, inputs.input_ids, md.positions,
                                     num_fixed=1)
        for name in self._layer_names:  # every call of one key has the same argument shapes
            self.counter.note(name, x, extra, md)
        caches = list(self.kv_pool.caches)
        for key, _, first, end, tensors, _ in self._calls:
            x, updated = self._layers[key](p.layer_leaves[first:end], [caches[t] for t in tensors], x, extra, md)
            for t, cache in zip(tensors, updated):
                caches[t] = cache
        self.kv_pool.caches = caches
        hidden = self.counter.call("rows", self._take_rows, x, inputs.logits_indices)
        prompt_hidden = None if prompt_lp is None else self.counter.call("rows", self._take_rows, x,
                                                                         prompt_lp.indices)
        logits, prompt_out = self.counter.call("head", self._head, p.shell_state, hidden, prompt_hidden,
                                               prompt_lp, num_fixed=1)
        return self.counter.call("sample", self._sample, logits, sampling), prompt_out

    # LoRA adapters ---------------------------------------------------------------------------------------
    def write_lora_slots(self, loads) -> None:
        """Writes each (slot, LoRARequest) adapter into its device slot, in place (`DeviceSlotWriter`):
        the same shapes in the state the jitted pieces take, so nothing recompiles."""
        if not loads:
            return
        try:
            adapters = [(slot, self.lora.adapter(request)) for slot, request in loads]  # a re-read may fail
        except Exception:
            for slot, _ in loads:
                self.lora.slots.forget_slot(slot)
            raise
        leaves, treedef = jax.tree.flatten(self.state)
        replaced = {}
        for slot, adapter in adapters:
            replaced.update(self._lora_writer.write(leaves, slot, adapter))
        self.state = jax.tree.unflatten(treedef, leaves)
        if self.pieces is not None:  # the layers' leaf lists hold the same stacks
            for layer_leaves in self.pieces.layer_leaves:
                for i, leaf in enumerate(layer_leaves):
                    while id(leaf) in replaced:  # written more than once this step
                        leaf = replaced[id(leaf)]
                    layer_leaves[i] = leaf

    def _lora_padding(self, num_tokens: int):
        """The `LoRAInputs` of a step of padding tokens alone (None without LoRA)."""
        if not self.num_lora_slots:
            return None
        from jpaged.runner.inputs import lora_inputs
        return lora_inputs(np.zeros(num_tokens, np.int32), self.num_lora_slots)

    # The jitted functions' parameters ------------------------------------------------------------------
    @property
    def _md_layout(self):
        """The metadata's ``kv_layout`` (None for the one-group layout, the layers' default)."""
        return None if self.kv_layout.is_trivial else self.kv_layout.layers

    def _params(self):
        return self.state if self.pieces is None else (self.pieces.shell_state, self.pieces.layer_leaves)

    def _logits(self, params, kv_caches, input_ids, md, logits_indices):
        """The sampled rows' logits, traced whole (embed, every layer, head): a decode window's step."""
        if self.pieces is None:
            return whole_logits(self.graphdef, params, kv_caches, input_ids, md, logits_indices)
        p, (shell_state, layer_leaves) = self.pieces, params
        x, extra = p.embed(shell_state, input_ids, md.positions)
        caches = list(kv_caches)
        for _, structure, first, end, tensors, layout in self._calls:
            x, updated = p.layer_fns[structure](layout, layer_leaves[first:end], [caches[t] for t in tensors], x,
                                                extra, md)
            for t, cache in zip(tensors, updated):
                caches[t] = cache
        return p.head(shell_state, x[logits_indices])[0], caches

    # Precompiling -----------------------------------------------------------------------------------------
    def compile_heads(self, max_tokens: int, max_rows: int) -> None:
        """Compiles what follows the layers for every sampled-row bucket: taking the rows out of
        each token bucket, the logits, and the sampler (greedy, and sampled without penalties or
        filters), and a draft model's proposal loop. A whole-step runner compiles these with its
        steps (`precompile`)."""
        if self.pieces is None:
            return
        hidden_size = self.config.hidden_size
        with jax.set_mesh(self.mesh):
            for t_pad in self.buckets.token_buckets(max_tokens):
                x = np.zeros((t_pad, hidden_size), self.dtype)
                for r_pad in self.buckets.row_buckets(t_pad):
                    self.counter.call("rows", self._take_rows, x, np.zeros(r_pad, np.int32))
                    if self.drafter is not None:
                        self.drafter.compile(self.buckets.shape(t_pad, 1, 1), r_pad)
            for r_pad in self.buckets.token_buckets(max_rows):
                hidden = np.zeros((r_pad, hidden_size), self.dtype)
                logits, _ = self.counter.call("head", self._head, self.pieces.shell_state, hidden, None, None,
                                              num_fixed=1)
                for batch in plain_sampling(r_pad):
                    jax.block_until_ready(self.counter.call("sample", self._sample, logits,
                                                            sampling_tensors(batch, r_pad,
                                                                             self.processed_logprobs)))

    def compile_decode_windows(self, max_seqs: int) -> None:
        """Queues the background compile of the decode window of every decode-only batch shape
        (greedy, and sampled without penalties or filters); `window_compiler.wait()` waits for them."""
        for rows in self.buckets.token_buckets(max_seqs):
            t_pad, s_pad, b_pad = self.buckets.shape(rows, rows, 1)
            more = self.kv_layout.num_groups - 1
            md = make_attention_metadata(
                self.attention_backend, positions=np.zeros(t_pad), slot_mapping=np.full(t_pad, -1),
                query_start_loc=np.zeros(s_pad + 1), seq_lens=np.zeros(s_pad), num_seqs=0,
                block_tables=np.zeros((s_pad, b_pad)), kv_layout=self._md_layout,
                group_slot_mappings=np.full((more, t_pad), -1) if more else None,
                group_block_tables=np.zeros((more, s_pad, b_pad)) if more else None,
                lora=self._lora_padding(t_pad),
                state_slots=np.full(s_pad, -1) if self.kv_layout.num_recurrent else None)
            for batch in plain_sampling(rows):
                self._ready_window((self._params(), self.kv_pool.caches, np.zeros(t_pad, np.int32), md,
                                    np.zeros(rows, np.int32), sampling_tensors(batch, rows, self.processed_logprobs),
                                    np.int32(0)), now=True)


def plain_sampling(rows: int) -> list[SamplingBatch]:
    """The sampling of ``rows`` rows that precompiling covers: greedy, and sampled without penalties
    or filters."""
    return [SamplingBatch(**per_row_values([SamplingParams(temperature=t)] * rows), seeds=[0] * rows,
                          steps=[0] * rows, banned_token_ids=[[]] * rows, bias=[[]] * rows,
                          allowed_token_ids=[[]] * rows, token_bitmask=np.zeros((rows, 0), np.int32))
            for t in (0.0, 1.0)]
