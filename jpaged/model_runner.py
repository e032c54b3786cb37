"""Host arrays -> padded static-shape batch -> jitted step -> sampled tokens.

Every array is padded to a bucket that follows from the step's token count (`ModelRunner.buckets`),
so the step compiles once per token bucket (and sampled-row bucket) and never again in steady
state. The step runs piece by piece (`LayerPieces`); each layer's KV pool is donated to its call, so
XLA updates it in place.
"""
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jpaged_kernels

from jpaged import prompt_logprobs, sharding
from jpaged.attention import attention_backend_of, make_attention_metadata
from jpaged.core.scheduler import SchedulerOutput
from jpaged.sampler import sample
from jpaged.sampling_batch import build_sampling_tensors
from jpaged.utils import bucket, cdiv, pad_rows, padded_ids, step_bucket

LAYERS_PER_CALL = 6  # one jitted call runs up to this many layers: compile cost vs dispatches
MIN_TOKENS = 2  # XLA CPU runs [1, K] x [K, N] matmuls far slower than [2, K]
MIN_ROWS = 2


@dataclasses.dataclass
class StepResult:
    """Sampled tokens, one per sample row of the step."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    prompt_logprobs: tuple | None = None  # (target logprobs, top ids, top logprobs) per prompt row
    prepare_seconds: float = 0.0  # host: copies, swaps, batch, metadata, sampling tensors
    device_seconds: float = 0.0   # dispatch until the sampled tokens are on the host


def _take_rows(x, indices):
    return x[indices]


def _next_decode_step(md, tokens, block_size: int):
    """A decode-only step's successor, on the device: each sequence's sampled token becomes its
    input at the next position (token ``i`` of a decode-only step is sequence ``i``'s)."""
    real = md.slot_mapping >= 0
    positions = md.positions + 1
    blocks = jnp.take_along_axis(md.block_tables, (positions // block_size)[:, None], axis=1, mode="clip")[:, 0]
    md = dataclasses.replace(md, positions=jnp.where(real, positions, 0),
                             slot_mapping=jnp.where(real, blocks * block_size + positions % block_size, -1),
                             seq_lens=jnp.where(md.seq_lens > 0, md.seq_lens + 1, 0))
    return jnp.where(real, tokens[:real.shape[0]], 0), md


# A layer's cache is a tuple of pool arrays that all lead with [Hkv, ...]: (k_pages, v_pages), or
# with 8-bit pages (k_pages, v_pages, kv_scales) (`jpaged_kernels.pool`). Block moves go through
# `jpaged_kernels.pool`, so scale words always travel with their pages.

def _gather_blocks(kv_caches, blocks):
    """The blocks of every layer, for the host: one [L, Hkv, len(blocks), block_size, ...] array per
    pool array of a layer (K and V pages, then scale words)."""
    per_layer = [jpaged_kernels.pool.take_blocks(layer, blocks) for layer in kv_caches]
    return tuple(jnp.stack(arrays) for arrays in zip(*per_layer))


def _scatter_blocks(kv_caches, blocks, data):
    """Writes `_gather_blocks`'s ``data`` into ``blocks`` (negative ids: dropped)."""
    return [jpaged_kernels.pool.put_blocks(layer, blocks, tuple(d[i] for d in data))
            for i, layer in enumerate(kv_caches)]


def _copy_blocks(kv_caches, src, dst):
    def copy(layer, src, dst):
        return jpaged_kernels.copy_blocks(*layer[:2], src, dst, **jpaged_kernels.quant.scales_of(layer))

    if sharding.model_axis_size() > 1:  # the kernel copies each device's slice of the blocks
        copy = sharding.shard_heads(copy, (sharding.POOL, sharding.REPLICATED, sharding.REPLICATED),
                                    sharding.POOL)
    return [copy(tuple(layer), src, dst) for layer in kv_caches]


class LayerPieces:
    """A model split into the pieces the runner jits separately: an embedding shell (the model
    without its decoder layers), and the layers, each with its own state, run in calls of up to
    `LAYERS_PER_CALL` consecutive layers of one structure (calls of one structure and length share
    one jitted function).

    A model takes part by providing ``embed_inputs(input_ids, positions) -> (x, extra)`` (``extra``:
    arrays every layer takes after ``x``, e.g. rotary cos/sin), ``norm_output(hidden)`` (the final
    norm, applied per row), ``compute_logits`` and ``DECODER_LAYERS``, the name of its list of
    layers, each called ``layer(x, *extra, kv_cache, md) -> (x, kv_cache)``. Other models run
    whole (``__call__`` in one jit).
    """

    def __init__(self, model):
        name = model.DECODER_LAYERS
        layers = list(getattr(model, name))
        setattr(model, name, nnx.List([]))
        try:
            shell_graphdef, self.shell_state = nnx.split(model)
        finally:
            setattr(model, name, nnx.List(layers))
        graphdefs, treedefs, self.layer_leaves, self.layer_groups = [], [], [], []
        for layer in layers:
            graphdef, state = nnx.split(layer)
            leaves, treedef = jax.tree.flatten(state)  # a list of arrays: fast to pass to a jit
            if (graphdef, treedef) not in zip(graphdefs, treedefs):
                graphdefs.append(graphdef)
                treedefs.append(treedef)
            self.layer_groups.append(list(zip(graphdefs, treedefs)).index((graphdef, treedef)))
            self.layer_leaves.append(leaves)
        self.calls = []  # (structure, first layer, end): consecutive layers of one structure
        for i, group in enumerate(self.layer_groups):
            last = self.calls[-1] if self.calls else None
            if last and last[0] == group and last[2] == i and i - last[1] < LAYERS_PER_CALL:
                self.calls[-1] = (group, last[1], i + 1)
            else:
                self.calls.append((group, i, i + 1))

        def embed(shell_state, input_ids, positions):
            return nnx.merge(shell_graphdef, shell_state).embed_inputs(input_ids, positions)

        def layers_fn(graphdef, treedef, leaves_per_layer, kv_caches, x, extra, md):
            new_caches = []
            for leaves, kv_cache in zip(leaves_per_layer, kv_caches):
                x, kv_cache = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(x, *extra, kv_cache, md)
                new_caches.append(kv_cache)
            return x, new_caches

        def head(shell_state, hidden, prompt_hidden=None, prompt_lp=None):
            """Final norm and logits of the sampled rows (and of the prompt-logprob rows)."""
            model = nnx.merge(shell_graphdef, shell_state)
            prompt_out = None
            if prompt_lp is not None:
                logits = model.compute_logits(model.norm_output(prompt_hidden))
                prompt_out = prompt_logprobs.compute(logits, prompt_lp)
            return model.compute_logits(model.norm_output(hidden)), prompt_out

        self.embed, self.head = embed, head
        self.layer_fns = [functools.partial(layers_fn, g, t) for g, t in zip(graphdefs, treedefs)]

    @classmethod
    def of(cls, model) -> "LayerPieces | None":
        if all(hasattr(model, a) for a in ("DECODER_LAYERS", "embed_inputs", "norm_output")):
            return cls(model)
        return None


class ModelRunner:
    """Owns the device side: parameters, the KV pool, and the jitted functions that use them.

    ``execute(scheduler_output)`` reads only the output's plain data (tokens, positions, block
    tables, copies, swaps, sample rows), never the scheduler or the KV cache manager.
    """

    def __init__(self, model, *, num_blocks: int, block_size: int, dtype, mesh, seed: int = 0,
                 max_num_seqs: int = 256, max_model_len: int | None = None, kv_cache_dtype=None,
                 max_decode_window: int = 1):
        """``dtype``: the KV pages' dtype; ``kv_cache_dtype`` (int8 or float8_e4m3fn), when given,
        overrides it with 8-bit pages plus per-(token, head) scales. ``max_num_seqs`` and
        ``max_model_len`` bound the step shapes (`buckets`); ``max_decode_window``: the most decode
        steps one `execute_window` runs."""
        self.config = model.config
        self.max_seqs_bucket = step_bucket(max_num_seqs, MIN_ROWS)
        self.max_blocks_per_seq = cdiv(max_model_len or model.config.max_position_embeddings, block_size)
        self.mesh = mesh
        self.attention_backend = attention_backend_of(model)
        graphdef, state = nnx.split(model)
        self.graphdef, self.state = graphdef, sharding.shard_state(state, mesh)
        self.block_size = block_size
        self.num_blocks, self.dtype = num_blocks, dtype
        self.kv_cache_dtype = kv_cache_dtype if kv_cache_dtype is not None else dtype
        self.seed = seed
        self.kv_caches = self._new_kv_pool()
        replicated = NamedSharding(mesh, P())
        self._replicated = replicated
        pool = jax.tree.map(lambda x: sharding.kv_pool_sharding(mesh, x.ndim), self.kv_caches)
        self.pieces = LayerPieces.of(nnx.merge(graphdef, self.state))  # a view: the sharded arrays
        if self.pieces is None:  # a model with only __call__: one jit for the whole forward
            self._forward_jit = jax.jit(self._forward_fn, donate_argnums=(1,), out_shardings=(replicated, pool))
            self._forward = self._forward_whole
        else:  # embed, one jit per layer structure (shared by the layers), head
            self._embed = jax.jit(self.pieces.embed)
            self._layers = {(group, end - first): jax.jit(self.pieces.layer_fns[group], donate_argnums=(1,),
                                                          out_shardings=(replicated, pool[first:end]))
                            for group, first, end in self.pieces.calls}
            self._take_rows = jax.jit(_take_rows)  # apart from the head: it alone depends on both counts
            self._head = jax.jit(self.pieces.head, out_shardings=replicated)
            self._forward = self._forward_by_layer
        self._sample = jax.jit(sample)
        self._window = jax.jit(functools.partial(self._window_fn, max_steps=max_decode_window),
                               donate_argnums=(1,), out_shardings=(replicated, pool))
        self._copy = jax.jit(_copy_blocks, donate_argnums=(0,))
        self._gather = jax.jit(_gather_blocks, out_shardings=replicated)
        self._scatter = jax.jit(_scatter_blocks, donate_argnums=(0,))
        self.host_blocks: dict[int, tuple] = {}  # seq_id -> swapped-out blocks per pool array (host memory)
        self._signatures: set = set()  # distinct argument shapes seen by each jitted function

    def _new_kv_pool(self):
        """Per layer ``(k_pages, v_pages)``, or with 8-bit pages ``(k_pages, v_pages, kv_scales)``
        (`jpaged_kernels.pool.layer_arrays`)."""
        c = self.config
        arrays = jpaged_kernels.pool.layer_arrays(c.num_kv_heads, self.num_blocks, self.block_size, c.head_dim,
                                                  self.kv_cache_dtype)
        return [tuple(sharding.zeros_sharded(s, dt, sharding.kv_pool_sharding(self.mesh, len(s))) for s, dt in arrays)
                for _ in range(c.num_layers)]

    def kv_pool_lost(self) -> bool:
        """Whether a failed step consumed the donated pool (then `reset_kv_pool` makes a new one)."""
        return any(x.is_deleted() for layer in self.kv_caches for x in layer)

    def reset_kv_pool(self) -> None:
        self.kv_caches = self._new_kv_pool()
        self.host_blocks.clear()

    @property
    def num_compilations(self) -> int:
        """Distinct argument shapes the jitted step, sampler and block copy have been called with:
        each is one compilation (or one load from the persistent compilation cache)."""
        return len(self._signatures)

    def _note(self, name: str, *args) -> None:
        """Notes the argument shapes ``name`` is called with (one compilation per distinct set)."""
        leaves, treedef = jax.tree.flatten(args)
        self._signatures.add((name, treedef, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)))

    def _call(self, name: str, fn, *args, num_fixed: int = 0):
        """``fn(*args)``, noting the shapes of the arguments after the first ``num_fixed`` (whose
        shapes never change: parameters, the pool)."""
        self._note(name, *args[num_fixed:])
        return fn(*args)

    def _forward_fn(self, state, kv_caches, input_ids, md, logits_indices, prompt_lp=None):
        """Logits of the sampled rows (and the prompt-logprob rows' results, when asked for)."""
        model = nnx.merge(self.graphdef, state)
        hidden, kv_caches = model(input_ids, md.positions, kv_caches, md)
        prompt_out = None
        if prompt_lp is not None:
            prompt_out = prompt_logprobs.compute(model.compute_logits(hidden[prompt_lp.indices]), prompt_lp)
        return (model.compute_logits(hidden[logits_indices]), prompt_out), kv_caches

    def _forward_whole(self, state, kv_caches, input_ids, md, logits_indices, prompt_lp=None):
        return self._call("forward", self._forward_jit, state, kv_caches, input_ids, md, logits_indices,
                          prompt_lp, num_fixed=2)

    def _forward_by_layer(self, state, kv_caches, input_ids, md, logits_indices, prompt_lp=None):
        """The same result as `_forward_whole`, as embed -> calls of up to `LAYERS_PER_CALL` layers
        -> head: each piece compiles once per shape, whatever the number of layers (a 30-layer model
        traces and compiles six layers, not thirty). ``state`` is unused: the pieces hold their own
        parameters. Each layer's pages are donated to its call."""
        del state
        p = self.pieces
        md = jax.device_put(md, self._replicated)  # once, not once per layer
        x, extra = self._call("embed", self._embed, p.shell_state, input_ids, md.positions, num_fixed=1)
        for group, count in self._layers:  # every call of one key has the same argument shapes
            self._note(f"layers{group}x{count}", x, extra, md)
        new_caches = []
        for group, first, end in p.calls:
            x, caches = self._layers[group, end - first](p.layer_leaves[first:end], kv_caches[first:end], x, extra, md)
            new_caches += caches
        hidden = self._call("rows", self._take_rows, x, logits_indices)
        prompt_hidden = None if prompt_lp is None else self._call("rows", self._take_rows, x, prompt_lp.indices)
        out = self._call("head", self._head, p.shell_state, hidden, prompt_hidden, prompt_lp, num_fixed=1)
        return out, new_caches

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """All copy-on-write copies of one step, in one call."""
        if not copies:
            return
        src, dst = (padded_ids(list(ids), 4) for ids in zip(*copies))
        with jax.set_mesh(self.mesh):
            self.kv_caches = self._call("copy", self._copy, self.kv_caches, src, dst, num_fixed=1)

    def swap_out(self, swaps: list[tuple[int, list[int]]]) -> None:
        """Copies preempted sequences' blocks to host memory (one device -> host transfer)."""
        if not swaps:
            return
        blocks = [b for _, table in swaps for b in table]
        data = jax.device_get(self._gather(self.kv_caches, padded_ids(blocks, 4, fill=0)))
        start = 0
        for seq_id, table in swaps:  # each array: [L, Hkv, blocks, block_size, ...]
            self.host_blocks[seq_id] = tuple(d[:, :, start:start + len(table)] for d in data)
            start += len(table)

    def swap_in(self, swaps: list[tuple[int, list[int]]]) -> None:
        """Writes swapped sequences back into their new blocks (one host -> device transfer)."""
        if not swaps:
            return
        parts = [self.host_blocks.pop(seq_id) for seq_id, _ in swaps]
        blocks = padded_ids([b for _, table in swaps for b in table], 4)
        data = []
        for arrays in zip(*parts):  # each pool array: [L, Hkv, blocks, block_size, ...]
            d = np.concatenate(arrays, axis=2)
            pad = np.zeros(d.shape[:2] + (len(blocks) - d.shape[2],) + d.shape[3:], d.dtype)
            data.append(np.concatenate([d, pad], axis=2))
        self.kv_caches = self._scatter(self.kv_caches, blocks, tuple(data))

    def discard_swapped(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.host_blocks.pop(seq_id, None)

    def execute(self, out: SchedulerOutput) -> StepResult:
        start = time.perf_counter()
        self.swap_out(out.swap_out)  # before anything this step writes into the freed blocks
        self.swap_in(out.swap_in)
        self.copy_blocks(out.block_copies)
        input_ids, md, logits_indices, prompt_lp = self.prepare(out)
        rows = out.sample_rows
        sampling = build_sampling_tensors(rows, logits_indices.shape[0], self.seed)
        prepared = time.perf_counter()
        with jax.set_mesh(self.mesh):
            (logits, prompt_out), self.kv_caches = self._forward(
                self.state, self.kv_caches, input_ids, md, logits_indices, prompt_lp)
            sampled = self._call("sample", self._sample, logits, sampling)
        n = len(rows)
        result = StepResult(*(np.asarray(a)[:n] for a in sampled),
                            prompt_logprobs=None if prompt_out is None else tuple(np.asarray(a) for a in prompt_out))
        result.prepare_seconds, result.device_seconds = prepared - start, time.perf_counter() - prepared
        return result

    def execute_window(self, out: SchedulerOutput, num_steps: int) -> list[StepResult]:
        """``num_steps`` decode steps of ``out``'s sequences (`Scheduler.plan_decode_window`) in one
        jitted loop: each step's sampled tokens are the next step's inputs, on the device; the host
        prepares once and reads every step's tokens at the end."""
        start = time.perf_counter()
        input_ids, md, logits_indices, _ = self.prepare(out)
        rows = out.sample_rows
        sampling = build_sampling_tensors(rows, logits_indices.shape[0], self.seed)
        min_tokens = np.zeros(logits_indices.shape[0], np.int32)
        min_tokens[:len(rows)] = [r.request.sampling_params.min_tokens for r in rows]
        prepared = time.perf_counter()
        with jax.set_mesh(self.mesh):
            sampled, self.kv_caches = self._call(
                "window", self._window, self._params(), self.kv_caches, input_ids, md, logits_indices,
                sampling, min_tokens, np.int32(num_steps), num_fixed=2)
        n = len(rows)
        sampled = [np.asarray(a) for a in sampled]  # each [max steps, rows, ...]
        results = [StepResult(*(a[i, :n] for a in sampled)) for i in range(num_steps)]
        results[0].prepare_seconds, results[0].device_seconds = prepared - start, time.perf_counter() - prepared
        return results

    def _params(self):
        return self.state if self.pieces is None else (self.pieces.shell_state, self.pieces.layer_leaves)

    def _logits_fn(self, params, kv_caches, input_ids, md, logits_indices):
        """The sampled rows' logits, traced whole (embed, every layer, head) for a decode window."""
        if self.pieces is None:
            (logits, _), kv_caches = self._forward_fn(params, kv_caches, input_ids, md, logits_indices)
            return logits, kv_caches
        p, (shell_state, layer_leaves) = self.pieces, params
        x, extra = p.embed(shell_state, input_ids, md.positions)
        new_caches = []
        for group, first, end in p.calls:
            x, caches = p.layer_fns[group](layer_leaves[first:end], kv_caches[first:end], x, extra, md)
            new_caches += caches
        return p.head(shell_state, x[logits_indices])[0], new_caches

    def _window_fn(self, params, kv_caches, input_ids, md, logits_indices, sampling, min_tokens, num_steps, *,
                   max_steps):
        """Up to ``max_steps`` decode steps in a loop of ``num_steps`` (a run-time count): sampled
        tokens, logprobs and top logprobs of every step, ``[max_steps, rows, ...]``. A row's banned
        tokens (EOS and stop tokens) stay banned until it has ``min_tokens`` output tokens."""
        def step(i, carry):
            kv_caches, input_ids, md, outs = carry
            logits, kv_caches = self._logits_fn(params, kv_caches, input_ids, md, logits_indices)
            steps = sampling.steps + i  # each row's output tokens so far: its draw's key, its bans
            banned = jnp.where((steps < min_tokens)[:, None], sampling.banned_token_ids, -1)
            sampled = sample(logits, dataclasses.replace(sampling, steps=steps, banned_token_ids=banned))
            outs = tuple(o.at[i].set(x) for o, x in zip(outs, sampled))
            input_ids, md = _next_decode_step(md, sampled[0], self.block_size)
            return kv_caches, input_ids, md, outs

        shapes = jax.eval_shape(sample, jax.ShapeDtypeStruct((logits_indices.shape[0], self.config.vocab_size),
                                                             jnp.float32), sampling)
        outs = tuple(jnp.zeros((max_steps,) + x.shape, x.dtype) for x in shapes)
        kv_caches, _, _, outs = jax.lax.fori_loop(0, num_steps, step, (kv_caches, input_ids, md, outs))
        return outs, kv_caches

    def prepare(self, out: SchedulerOutput):
        """The step's flat token batch, padded to step buckets (`utils.step_bucket`), and its
        attention metadata."""
        bs = self.block_size
        input_ids, positions, slots, seq_lens, tables = [], [], [], [], []
        query_start_loc = [0]
        for seq in out.seqs:
            n = len(seq.token_ids)
            pos = np.arange(seq.start, seq.start + n)
            input_ids.extend(seq.token_ids)
            positions.append(pos)
            slots.append(np.asarray(seq.block_table, np.int32)[pos // bs] * bs + pos % bs)
            seq_lens.append(seq.start + n)
            tables.append(seq.block_table)
            query_start_loc.append(query_start_loc[-1] + n)
        logits_indices = [query_start_loc[r.seq_row + 1] - 1 for r in out.sample_rows]
        t, s = len(input_ids), len(out.seqs)
        t_pad, s_pad, b_pad = self.buckets(t, s, max(len(tb) for tb in tables))
        qsl = np.full(s_pad + 1, t, np.int32)
        qsl[:s + 1] = query_start_loc
        md = make_attention_metadata(
            self.attention_backend,
            positions=np.concatenate(positions + [np.zeros(t_pad - t, np.int64)]),
            slot_mapping=np.concatenate(slots + [np.full(t_pad - t, -1, np.int32)]),
            query_start_loc=qsl,
            seq_lens=np.array(seq_lens + [0] * (s_pad - s), np.int32),
            block_tables=pad_rows(tables, s_pad, b_pad, fill=0),
            num_seqs=s)
        ids = np.zeros(t_pad, np.int32)
        ids[:t] = input_ids
        rows = out.prompt_logprob_rows
        prompt_lp = prompt_logprobs.build(
            [(r.request, r.position) for r in rows],
            [query_start_loc[r.seq_row] + r.position - out.seqs[r.seq_row].start for r in rows],
            [r.target for r in rows])
        rows = np.zeros(self.rows_bucket(len(logits_indices), t_pad), np.int32)
        rows[:len(logits_indices)] = logits_indices
        return ids, md, rows, prompt_lp

    def token_buckets(self, max_tokens: int) -> list[int]:
        """Every padded token count a step of at most ``max_tokens`` tokens can have."""
        sizes = [step_bucket(MIN_TOKENS)]
        while sizes[-1] < step_bucket(max_tokens, MIN_TOKENS):
            sizes.append(step_bucket(sizes[-1] + 1))
        return sizes

    @staticmethod
    def rows_bucket(num_rows: int, t_pad: int) -> int:
        """The padded sampled-row count of a step of ``t_pad`` padded tokens: the step bucket where
        the rows fill the step (decode), else a power of two of at most ``t_pad``. A step with
        prompt tokens samples few rows, and the coarse sizes keep the (tokens, rows) pairs that
        compile few."""
        fine = step_bucket(num_rows, MIN_ROWS)
        return fine if fine >= t_pad else min(bucket(num_rows, MIN_ROWS), t_pad)

    def compile_heads(self, max_tokens: int, max_seqs: int) -> None:
        """Compiles what follows the layers for every sampled-row bucket: taking the rows out of
        each token bucket, the logits, and the sampler (greedy, and sampled without penalties or
        filters)."""
        if self.pieces is None:  # the whole-model forward compiles with its steps
            return
        row_buckets = self.token_buckets(max_seqs)
        with jax.set_mesh(self.mesh):
            for t_pad in self.token_buckets(max_tokens):
                x = np.zeros((t_pad, self.config.hidden_size), self.dtype)
                for r_pad in sorted({self.rows_bucket(r, t_pad) for r in range(1, min(t_pad, max_seqs) + 1)}):
                    self._call("rows", self._take_rows, x, np.zeros(r_pad, np.int32))
            for r_pad in row_buckets:
                hidden = np.zeros((r_pad, self.config.hidden_size), self.dtype)
                logits, _ = self._call("head", self._head, self.pieces.shell_state, hidden, None, None, num_fixed=1)
                for tensors in self._plain_sampling(r_pad):
                    jax.block_until_ready(self._call("sample", self._sample, logits, tensors))

    def _plain_sampling(self, rows: int):
        """The sampling tensors of ``rows`` rows that precompiling covers: greedy, and sampled
        without penalties or filters."""
        for greedy in (True, False):
            tensors = build_sampling_tensors([], rows, self.seed)
            tensors.all_greedy = greedy
            yield tensors

    def compile_decode_windows(self, max_seqs: int) -> None:
        """Compiles the decode window of every decode-only batch shape (greedy, and sampled without
        penalties or filters)."""
        for rows in self.token_buckets(max_seqs):
            t_pad, s_pad, b_pad = self.buckets(rows, rows, 1)
            md = make_attention_metadata(
                self.attention_backend, positions=np.zeros(t_pad), slot_mapping=np.full(t_pad, -1),
                query_start_loc=np.zeros(s_pad + 1), seq_lens=np.zeros(s_pad), num_seqs=0,
                block_tables=np.zeros((s_pad, b_pad)))
            for tensors in self._plain_sampling(rows):
                with jax.set_mesh(self.mesh):
                    _, self.kv_caches = self._call(
                        "window", self._window, self._params(), self.kv_caches, np.zeros(t_pad, np.int32), md,
                        np.zeros(rows, np.int32), tensors, np.zeros(rows, np.int32), np.int32(0), num_fixed=2)

    def buckets(self, num_tokens: int, num_seqs: int, num_blocks: int) -> tuple[int, int, int]:
        """Padded (tokens, sequences, blocks per sequence) of a step.

        Tokens go to a step bucket (`utils.step_bucket`: 2, 4, 8, 16, 24, 32, 48, 64, ...; at least
        `MIN_TOKENS`); the sequence count follows from it (as many rows as tokens, at most the
        ``max_num_seqs`` bucket unless the step has more sequences, as forking samples can), and on
        the ``xla`` backend every block table has the columns of ``max_model_len``: its attention
        loops only over real rows and blocks, so neither costs work, and a step's shapes depend on
        its token count alone. The Pallas kernels keep block tables in scalar memory: there the
        columns are the step's longest table's bucket.
        """
        t_pad = step_bucket(num_tokens, MIN_TOKENS)
        s_pad = max(min(t_pad, self.max_seqs_bucket), step_bucket(num_seqs, MIN_ROWS))
        if self.attention_backend == "xla":
            return t_pad, s_pad, bucket(self.max_blocks_per_seq)
        return t_pad, s_pad, bucket(num_blocks, 4)
