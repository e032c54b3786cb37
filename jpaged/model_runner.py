"""Host arrays -> padded static-shape batch -> jitted step -> sampled tokens.

Every array is padded to a power-of-two bucket (tokens, sequences, blocks per sequence, query
chunks), so the step compiles once per bucket combination and never again in steady state. The KV
pool is donated to the step, so XLA updates it in place.
"""
import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels

from jpaged import sharding
from jpaged.attention import PREFILL_CHUNK, AttentionMetadata
from jpaged.core.scheduler import SampleRow, SchedulerOutput
from jpaged.sampler import SamplingTensors, sample
from jpaged.utils import next_power_of_two


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum); 0 stays 0 when minimum is 0."""
    n = max(n, minimum)
    return 0 if n == 0 else next_power_of_two(n)


def _padded_ids(values: list[int], minimum: int, fill: int = -1) -> np.ndarray:
    """int32 ids padded with ``fill`` to a power-of-two length (at least ``minimum``)."""
    out = np.full(bucket(len(values), minimum), fill, np.int32)
    out[:len(values)] = values
    return out


def _pad(rows: list, width: int, fill: int) -> np.ndarray:
    out = np.full((len(rows), width), fill, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


@dataclasses.dataclass
class StepResult:
    """Sampled tokens, one per sample row of the step."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def _gather_blocks(kv_caches, blocks):
    """[L, 2, Hkv, len(blocks), block_size, D]: the blocks of every layer, for the host."""
    return jnp.stack([jnp.stack([k[:, blocks], v[:, blocks]]) for k, v in kv_caches])


def _scatter_blocks(kv_caches, blocks, data):
    nb = kv_caches[0][0].shape[1]
    dst = jnp.where(blocks < 0, nb, blocks)
    return [(k.at[:, dst].set(data[i, 0], mode="drop"), v.at[:, dst].set(data[i, 1], mode="drop"))
            for i, (k, v) in enumerate(kv_caches)]


def _copy_blocks(kv_caches, src, dst):
    copy = pallas_kernels.copy_blocks
    if sharding.model_axis_size() > 1:  # the kernel copies each device's slice of the blocks
        copy = sharding.shard_heads(copy, num_args_sharded=2)
    return [copy(k, v, src, dst) for k, v in kv_caches]


class ModelRunner:
    """Owns the device side: parameters, the KV pool, and the jitted functions that use them.

    ``execute(scheduler_output)`` reads only the output's plain data (tokens, positions, block
    tables, copies, swaps, sample rows), never the scheduler or the KV cache manager.
    """

    def __init__(self, model, *, num_blocks: int, block_size: int, dtype, mesh, seed: int = 0):
        self.config = model.config
        self.mesh = mesh
        graphdef, state = nnx.split(model)
        self.graphdef, self.state = graphdef, sharding.shard_state(state, mesh)
        self.block_size = block_size
        self.num_blocks, self.dtype = num_blocks, dtype
        self.seed = seed
        self.kv_caches = self._new_kv_pool()
        replicated = NamedSharding(mesh, P())
        pool = sharding.kv_pool_sharding(mesh)
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,),
                                out_shardings=(replicated, jax.tree.map(lambda _: pool, self.kv_caches)))
        self._sample = jax.jit(sample)
        self._copy = jax.jit(_copy_blocks, donate_argnums=(0,))
        self._gather = jax.jit(_gather_blocks, out_shardings=replicated)
        self._scatter = jax.jit(_scatter_blocks, donate_argnums=(0,))
        self.host_blocks: dict[int, np.ndarray] = {}  # seq_id -> swapped-out blocks (host memory)
        self._signatures: set = set()  # distinct argument shapes seen by each jitted function

    def _new_kv_pool(self):
        c = self.config
        shape = (c.num_kv_heads, self.num_blocks, self.block_size, c.head_dim)
        pool = sharding.kv_pool_sharding(self.mesh)
        return [(sharding.zeros_sharded(shape, self.dtype, pool), sharding.zeros_sharded(shape, self.dtype, pool))
                for _ in range(c.num_layers)]

    def kv_pool_lost(self) -> bool:
        """Whether a failed step consumed the donated pool (then `reset_kv_pool` makes a new one)."""
        return any(k.is_deleted() or v.is_deleted() for k, v in self.kv_caches)

    def reset_kv_pool(self) -> None:
        self.kv_caches = self._new_kv_pool()
        self.host_blocks.clear()

    @property
    def num_compilations(self) -> int:
        """Distinct argument shapes the jitted step, sampler and block copy have been called with:
        each is one compilation (or one load from the persistent compilation cache)."""
        return len(self._signatures)

    def _call(self, name: str, fn, *args, num_fixed: int = 0):
        """``fn(*args)``, noting the shapes of the arguments after the first ``num_fixed`` (whose
        shapes never change: parameters, the pool)."""
        leaves, treedef = jax.tree.flatten(args[num_fixed:])
        self._signatures.add((name, treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)))
        return fn(*args)

    def _forward_fn(self, state, kv_caches, input_ids, md, logits_indices):
        model = nnx.merge(self.graphdef, state)
        hidden, kv_caches = model(input_ids, md.positions, kv_caches, md)
        return model.compute_logits(hidden[logits_indices]), kv_caches

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """All copy-on-write copies of one step, in one call."""
        if not copies:
            return
        src, dst = (_padded_ids(list(ids), 4) for ids in zip(*copies))
        with jax.set_mesh(self.mesh):
            self.kv_caches = self._call("copy", self._copy, self.kv_caches, src, dst, num_fixed=1)

    def swap_out(self, swaps: list[tuple[int, list[int]]]) -> None:
        """Copies preempted sequences' blocks to host memory (one device -> host transfer)."""
        if not swaps:
            return
        blocks = [b for _, table in swaps for b in table]
        data = np.asarray(self._gather(self.kv_caches, _padded_ids(blocks, 4, fill=0)))
        start = 0
        for seq_id, table in swaps:
            self.host_blocks[seq_id] = data[:, :, :, start:start + len(table)]
            start += len(table)

    def swap_in(self, swaps: list[tuple[int, list[int]]]) -> None:
        """Writes swapped sequences back into their new blocks (one host -> device transfer)."""
        if not swaps:
            return
        data = np.concatenate([self.host_blocks.pop(seq_id) for seq_id, _ in swaps], axis=3)
        blocks = _padded_ids([b for _, table in swaps for b in table], 4)
        pad = np.zeros(data.shape[:3] + (len(blocks) - data.shape[3],) + data.shape[4:], data.dtype)
        self.kv_caches = self._scatter(self.kv_caches, blocks, np.concatenate([data, pad], axis=3))

    def discard_swapped(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.host_blocks.pop(seq_id, None)

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.swap_out(out.swap_out)  # before anything this step writes into the freed blocks
        self.swap_in(out.swap_in)
        self.copy_blocks(out.block_copies)
        input_ids, md, logits_indices = self.prepare(out)
        rows = out.sample_rows
        sampling = self.sampling_tensors(rows, logits_indices.shape[0])
        with jax.set_mesh(self.mesh):
            logits, self.kv_caches = self._call("forward", self._forward, self.state, self.kv_caches,
                                                input_ids, md, logits_indices, num_fixed=2)
            sampled = self._call("sample", self._sample, logits, sampling)
        n = len(rows)
        return StepResult(*(np.asarray(a)[:n] for a in sampled))

    def prepare(self, out: SchedulerOutput):
        """The step's flat token batch, padded to power-of-two buckets, and its attention metadata."""
        bs = self.block_size
        input_ids, positions, slots, seq_lens, tables = [], [], [], [], []
        query_start_loc = [0]
        decode_chunks, prefill_chunks = [], []  # (row, first token, num tokens)
        for row, seq in enumerate(out.seqs):
            n, first = len(seq.token_ids), len(input_ids)
            pos = np.arange(seq.start, seq.start + n)
            input_ids.extend(seq.token_ids)
            positions.append(pos)
            slots.append(np.asarray(seq.block_table, np.int32)[pos // bs] * bs + pos % bs)
            seq_lens.append(seq.start + n)
            tables.append(seq.block_table)
            query_start_loc.append(first + n)
            if n == 1:
                decode_chunks.append((row, first, 1))
            else:
                prefill_chunks += [(row, first + c, min(PREFILL_CHUNK, n - c)) for c in range(0, n, PREFILL_CHUNK)]
        logits_indices = [query_start_loc[r.seq_row + 1] - 1 for r in out.sample_rows]
        t, s = len(input_ids), len(out.seqs)
        t_pad, s_pad = bucket(t, 16), bucket(s, 8)
        b_pad = bucket(max(len(tb) for tb in tables), 4)
        token_to_row = np.zeros(t_pad, np.int32)
        groups, offset = [], 0
        for chunks, width in ((decode_chunks, 1), (prefill_chunks, PREFILL_CHUNK)):
            c_pad = bucket(len(chunks), 0)
            chunk_seq = np.zeros(c_pad, np.int32)
            chunk_rows = np.full((c_pad, width), t_pad, np.int32)
            for i, (row, first, n) in enumerate(chunks):
                chunk_seq[i] = row
                chunk_rows[i, :n] = np.arange(first, first + n)
                token_to_row[first:first + n] = offset + i * width + np.arange(n)
            groups.append((chunk_seq, chunk_rows))
            offset += c_pad * width
        qsl = np.full(s_pad + 1, t, np.int32)
        qsl[:s + 1] = query_start_loc
        md = AttentionMetadata(
            slot_mapping=np.concatenate(slots + [np.full(t_pad - t, -1, np.int32)]).astype(np.int32),
            block_tables=_pad(tables + [[]] * (s_pad - s), b_pad, 0),
            seq_lens=np.array(seq_lens + [0] * (s_pad - s), np.int32),
            query_start_loc=qsl,
            num_seqs=np.array(s, np.int32),
            positions=np.concatenate(positions + [np.zeros(t_pad - t, np.int64)]).astype(np.int32),
            chunk_groups=tuple(groups),
            token_to_row=token_to_row)
        ids = np.zeros(t_pad, np.int32)
        ids[:t] = input_ids
        return ids, md, _padded_ids(logits_indices, 8, fill=0)

    def sampling_tensors(self, rows: list[SampleRow], s_pad: int) -> SamplingTensors:
        f32 = lambda vals, fill: np.array(vals + [fill] * (s_pad - len(vals)), np.float32)  # noqa: E731
        params = [row.request.sampling_params for row in rows]
        seeds, banned = [], []
        for row, p in zip(rows, params):
            base = p.seed if p.seed is not None else f"{self.seed}/{row.request.request_id}"
            seeds.append(zlib.crc32(f"{base}/{row.sample_index}".encode()))
            ban = []
            if row.seq.num_output_tokens < p.min_tokens:
                ban = list(row.request.eos_token_ids) + p.stop_token_ids
            banned.append(ban)
        use_penalties = any(p.uses_penalties for p in params)
        out_ids = [row.seq.output_token_ids for row in rows] if use_penalties else []
        prompt_ids = [row.seq.token_ids[:row.seq.num_prompt_tokens] for row in rows] if use_penalties else []
        pad_rows = lambda rs: _pad(rs + [[]] * (s_pad - len(rs)), bucket(max(map(len, rs), default=0), 0), -1)  # noqa: E731
        return SamplingTensors(
            temperature=f32([p.temperature for p in params], 0.0),
            top_k=np.array([p.top_k for p in params] + [0] * (s_pad - len(rows)), np.int32),
            top_p=f32([p.top_p for p in params], 1.0),
            min_p=f32([p.min_p for p in params], 0.0),
            seeds=np.array(seeds + [0] * (s_pad - len(rows)), np.uint32),
            steps=np.array([row.seq.num_output_tokens for row in rows] + [0] * (s_pad - len(rows)), np.int32),
            presence_penalty=f32([p.presence_penalty for p in params], 0.0),
            frequency_penalty=f32([p.frequency_penalty for p in params], 0.0),
            repetition_penalty=f32([p.repetition_penalty for p in params], 1.0),
            output_token_ids=pad_rows(out_ids) if use_penalties else np.zeros((s_pad, 0), np.int32),
            prompt_token_ids=pad_rows(prompt_ids) if use_penalties else np.zeros((s_pad, 0), np.int32),
            banned_token_ids=pad_rows(banned),
            num_logprobs=bucket(max(((p.logprobs or 0) for p in params), default=0), 0),
            use_filters=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
            use_penalties=use_penalties,
            all_greedy=all(p.temperature == 0 for p in params))
