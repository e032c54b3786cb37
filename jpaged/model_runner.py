"""Host arrays -> padded static-shape batch -> jitted step -> sampled tokens.

Every array is padded to a power-of-two bucket (tokens, sequences, blocks per sequence, query
chunks), so the step compiles once per bucket combination and never again in steady state. The KV
pool is donated to the step, so XLA updates it in place.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels

from jpaged import prompt_logprobs, sharding
from jpaged.attention import attention_backend_of, make_attention_metadata
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.scheduler import SchedulerOutput
from jpaged.sampler import sample
from jpaged.sampling_batch import build_sampling_tensors


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum); 0 stays 0 when minimum is 0."""
    n = max(n, minimum)
    return 0 if n == 0 else 1 << (n - 1).bit_length()


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
class SampleRow:
    """One row of logits to sample from: the sequence, and which of its request's samples it is.

    The first sampling step of a request with ``n > 1`` has n rows on the one prompt sequence; the
    engine then forks the sequence so each sample continues on its own.
    """

    request: object
    seq: object
    sample_index: int


@dataclasses.dataclass
class StepResult:
    """Sampled tokens, one per sample row."""

    rows: list[SampleRow]
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
    def __init__(self, model, kv_cache: KVCacheManager, *, num_blocks: int, dtype, mesh, seed: int = 0):
        self.config = model.config
        self.mesh = mesh
        self.attention_backend = attention_backend_of(model)
        graphdef, state = nnx.split(model)
        self.graphdef, self.state = graphdef, sharding.shard_state(state, mesh)
        self.kv_cache_manager = kv_cache
        self.block_size = kv_cache.block_size
        self.seed = seed
        c = self.config
        shape = (c.num_kv_heads, num_blocks, self.block_size, c.head_dim)
        pool = sharding.kv_pool_sharding(mesh)
        self.kv_caches = [(sharding.zeros_sharded(shape, dtype, pool), sharding.zeros_sharded(shape, dtype, pool))
                          for _ in range(c.num_layers)]
        replicated = NamedSharding(mesh, P())
        self._step = jax.jit(self._step_fn, donate_argnums=(1,),
                             out_shardings=(replicated, jax.tree.map(lambda _: pool, self.kv_caches)))
        self._copy = jax.jit(_copy_blocks, donate_argnums=(0,))
        self._gather = jax.jit(_gather_blocks, out_shardings=replicated)
        self._scatter = jax.jit(_scatter_blocks, donate_argnums=(0,))
        self.host_blocks: dict[int, np.ndarray] = {}  # seq_id -> swapped-out blocks (host memory)

    @property
    def num_compilations(self) -> int:
        return self._step._cache_size() + self._copy._cache_size()

    def _step_fn(self, state, kv_caches, input_ids, md, logits_indices, sampling, prompt_lp=None):
        model = nnx.merge(self.graphdef, state)
        hidden, kv_caches = model(input_ids, md.positions, kv_caches, md)
        logits = model.compute_logits(hidden[logits_indices])
        out = sample(logits, sampling)
        if prompt_lp is not None:
            out = out + prompt_logprobs.compute(model.compute_logits(hidden[prompt_lp.indices]), prompt_lp)
        return out, kv_caches

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """All copy-on-write copies of one step, in one call."""
        if not copies:
            return
        src, dst = (_padded_ids(list(ids), 4) for ids in zip(*copies))
        with jax.set_mesh(self.mesh):
            self.kv_caches = self._copy(self.kv_caches, src, dst)

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

    def execute(self, sched: SchedulerOutput) -> StepResult:
        self.swap_out(sched.swap_out)  # before anything this step writes into the freed blocks
        self.swap_in(sched.swap_in)
        self.copy_blocks(sched.block_copies)
        rows, batch = self.prepare(sched)
        sampling = build_sampling_tensors(rows, batch["logits_indices"].shape[0], self.seed)
        prompt_rows, prompt_targets = batch["prompt_rows"]
        with jax.set_mesh(self.mesh):
            out, self.kv_caches = self._step(
                self.state, self.kv_caches, batch["input_ids"], batch["md"], batch["logits_indices"], sampling,
                batch["prompt_lp"])
        tokens, logprobs, top_ids, top_lps = out[:4]
        if prompt_rows:
            prompt_logprobs.record(prompt_rows, prompt_targets, out[4:])
        n = len(rows)
        return StepResult(rows, *(np.asarray(a)[:n] for a in (tokens, logprobs, top_ids, top_lps)))

    def prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        rows, input_ids, positions, slots, seq_lens, tables = [], [], [], [], [], []
        sample_rows, logits_indices = [], []
        prompt_rows, prompt_indices, prompt_targets = [], [], []  # prompt_logprobs
        query_start_loc = [0]
        for sr in sched.scheduled:
            for seq in sr.request.live_seqs:
                start, n = seq.num_computed_tokens, sr.num_new_tokens
                first = len(input_ids)
                pos = np.arange(start, start + n)
                table = self.kv_cache_manager.block_table(seq)
                input_ids.extend(seq.token_ids[start:start + n])
                positions.append(pos)
                slots.append(np.asarray(table, np.int32)[pos // bs] * bs + pos % bs)
                seq_lens.append(start + n)
                tables.append(table)
                query_start_loc.append(first + n)
                rows.append((sr, seq))
                for p in prompt_logprobs.wanted(sr.request, seq, start, n):
                    prompt_rows.append((sr.request, p))
                    prompt_indices.append(first + p - start)
                    prompt_targets.append(seq.token_ids[p + 1])
                if sr.samples:
                    request = sr.request
                    first_of_many = (request.beam is None and len(request.seqs) == 1
                                     and request.sampling_params.n > 1)
                    for index in range(request.sampling_params.n) if first_of_many else [seq.index]:
                        sample_rows.append(SampleRow(request, seq, index))
                        logits_indices.append(first + n - 1)
        t, s = len(input_ids), len(rows)
        t_pad, s_pad = bucket(t, 16), bucket(s, 8)
        b_pad = bucket(max(len(tb) for tb in tables), 4)
        qsl = np.full(s_pad + 1, t, np.int32)
        qsl[:s + 1] = query_start_loc
        md = make_attention_metadata(
            self.attention_backend,
            positions=np.concatenate(positions + [np.zeros(t_pad - t, np.int64)]),
            slot_mapping=np.concatenate(slots + [np.full(t_pad - t, -1, np.int32)]),
            query_start_loc=qsl,
            seq_lens=np.array(seq_lens + [0] * (s_pad - s), np.int32),
            block_tables=_pad(tables + [[]] * (s_pad - s), b_pad, 0),
            num_seqs=s)
        padded_logits_indices = _padded_ids(logits_indices, 8, fill=0)
        ids = np.zeros(t_pad, np.int32)
        ids[:t] = input_ids
        return sample_rows, {"input_ids": ids, "md": md, "logits_indices": padded_logits_indices,
                             "prompt_lp": prompt_logprobs.build(prompt_rows, prompt_indices, prompt_targets),
                             "prompt_rows": (prompt_rows, prompt_targets)}
