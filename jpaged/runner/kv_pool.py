"""The device KV pool and its host swap buffer, with the block moves a step asks for.

A layer's cache is a tuple of pool arrays that all lead with ``[num_kv_heads, ...]``: ``(k_pages,
v_pages)``, or with 8-bit pages ``(k_pages, v_pages, kv_scales)`` (`pallas_kernels.pool`). Block
moves go through `pallas_kernels.pool`, so scale words always travel with their pages. The pool is
split over the mesh's ``model`` axis on its head axis (tensor parallelism).

A model with recurrent layers (`jpaged.core.recurrent_state`) also has a state pool per such layer:
a tuple of arrays ``[num_state_slots, ...]`` (a gated delta-net's conv inputs and recurrent
state), after the KV tensors in `caches`; forks copy slots (`copy_states`). Block moves touch the
KV tensors only.

Moves: copy-on-write copies (``copy_blocks``, one batched call per step), and swapping between
the device pool and a host buffer of ``num_host_blocks`` blocks (filled only when a request is
swapped out) by the block-id pairs of the step; and reading and writing whole blocks for the
prefix-cache tiers (`read_blocks`, `write_blocks`: `jpaged.core.kv_offload`). The tiers' moves go
in chunks of at most ``MAX_TRANSFER_BLOCKS`` blocks, each padded to a power of two, so the few
shapes of `transfer_buckets` cover every count and `compile_transfers` compiles them all at warm-up.
"""
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jpaged import sharding
from jpaged.runner.compile_counter import CompileCounter
from jpaged.utils import padded_ids

MAX_TRANSFER_BLOCKS = 64  # blocks per gather / scatter call of the tiers' moves; more go in several calls
MIN_TRANSFER_BLOCKS = 4


def transfer_buckets(num_blocks: int) -> list[int]:
    """The padded block counts a tier move of a pool of ``num_blocks`` blocks can have."""
    top = min(MAX_TRANSFER_BLOCKS, max(MIN_TRANSFER_BLOCKS, 1 << max(0, num_blocks - 1).bit_length()))
    buckets, n = [], MIN_TRANSFER_BLOCKS
    while n <= top:
        buckets.append(n)
        n *= 2
    return buckets


def _chunks(items: list) -> list[list]:
    return [items[i:i + MAX_TRANSFER_BLOCKS] for i in range(0, len(items), MAX_TRANSFER_BLOCKS)]


def jit_transfers(mesh, pool_shardings=None):
    """The jitted whole-block gather (to a replicated array) and scatter (the pool donated; its
    result placed and laid out as ``pool_shardings``, the pool's own, when given)."""
    return (jax.jit(_gather_blocks, out_shardings=sharding.replicated(mesh)),
            jax.jit(_scatter_blocks, donate_argnums=(0,), out_shardings=pool_shardings))


def _gather_blocks(kv_caches, blocks):
    """The blocks of every layer: one [L, Hkv, len(blocks), block_size, ...] array per pool array
    of a layer (K and V pages, then scale words)."""
    per_layer = [pallas_kernels.pool.take_blocks(layer, blocks) for layer in kv_caches]
    return tuple(jnp.stack(arrays) for arrays in zip(*per_layer))


def _scatter_blocks(kv_caches, blocks, data):
    """Writes `_gather_blocks`'s ``data`` into ``blocks`` (negative ids: dropped)."""
    return [pallas_kernels.pool.put_blocks(layer, blocks, tuple(d[i] for d in data))
            for i, layer in enumerate(kv_caches)]


def _copy_blocks(kv_caches, src, dst):
    def copy(layer, src, dst):
        return pallas_kernels.copy_blocks(*layer[:2], src, dst, **pallas_kernels.quant.scales_of(layer))

    if sharding.model_axis_size() > 1:  # the kernel copies each device's slice of the blocks
        copy = sharding.shard_heads(copy, (sharding.POOL, sharding.REPLICATED, sharding.REPLICATED),
                                    sharding.POOL)
    return [copy(tuple(layer), src, dst) for layer in kv_caches]


def _copy_states(state_pools, src, dst):
    """Copies slot ``src[i]`` into slot ``dst[i]`` of every state array (all read before any is
    written; negative destinations: dropped)."""
    def copy(array):
        rows = array[jnp.maximum(src, 0)]
        return array.at[jnp.where(dst < 0, array.shape[0], dst)].set(rows, mode="drop")

    return [tuple(copy(array) for array in layer) for layer in state_pools]


def state_bytes_per_slot(state_arrays, tensor_parallel_size: int = 1) -> int:
    """Bytes of one slot of every recurrent layer's state pool on one device (``state_arrays``: per
    layer, its `jpaged.models.gated_delta_net.StateArray`s; an array split by heads holds its
    devices' share)."""
    total = 0
    for layer in state_arrays:
        for a in layer:
            size = int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
            split = a.head_axis is not None and a.shape[a.head_axis] % tensor_parallel_size == 0
            total += size // tensor_parallel_size if split else size
    return total


def bytes_per_block(*, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype,
                    tensor_parallel_size: int = 1) -> int:
    """Bytes of one block of every layer on one device (its heads' slice, at least one head),
    scales of 8-bit pages included."""
    heads_per_device = max(1, num_kv_heads // tensor_parallel_size)
    return 2 * num_layers * heads_per_device * block_size * pallas_kernels.quant.bytes_per_row(head_dim, dtype)


class KVPool:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype, mesh, num_host_blocks: int = 0, counter: CompileCounter | None = None,
                 state_arrays=(), num_state_slots: int = 0):
        """``dtype``: the pages' dtype; int8 or float8_e4m3fn pages carry bfloat16 scales.
        ``state_arrays``: per recurrent layer, its `jpaged.models.gated_delta_net.StateArray`s,
        each pooled ``num_state_slots`` times after the ``num_layers`` KV tensors in `caches`."""
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.dtype, self.mesh = dtype, mesh
        self.state_arrays, self.num_state_slots = list(state_arrays), num_state_slots
        self.num_host_blocks = num_host_blocks
        self.counter = counter or CompileCounter()
        self.caches = self.new_caches()
        self.host: tuple[np.ndarray, ...] | None = None  # made at the first swap-out
        kv_shardings, state_shardings = self.kv_shardings(), self.state_shardings()
        self._copy = jax.jit(_copy_blocks, donate_argnums=(0,), out_shardings=kv_shardings)
        self._copy_states = jax.jit(_copy_states, donate_argnums=(0,), out_shardings=state_shardings)
        self._gather, self._scatter = jit_transfers(mesh, kv_shardings)

    def array_specs(self) -> list[tuple[tuple, object]]:
        """(shape, dtype) of each array of one layer's cache."""
        return pallas_kernels.pool.layer_arrays(*self.shape, self.dtype)

    def kv_shardings(self):
        """The sharding and row-major layout (`sharding.kv_pool_format`) of each array of every KV
        tensor: every jitted function that returns the pool keeps it so."""
        return [tuple(sharding.kv_pool_format(self.mesh, len(s)) for s, _ in self.array_specs())
                for _ in range(self.num_layers)]

    def state_shardings(self):
        """Each state array's sharding (`sharding.state_pool_sharding`), per recurrent layer."""
        return [tuple(sharding.state_pool_sharding(self.mesh, (self.num_state_slots,) + a.shape, a.head_axis)
                      for a in layer) for layer in self.state_arrays]

    def shardings(self):
        """The sharding of each array of every cache (the structure of `caches`): KV tensors, then
        state pools."""
        return self.kv_shardings() + self.state_shardings()

    def new_caches(self):
        kv = [tuple(sharding.zeros_sharded(s, dt, sharding.kv_pool_format(self.mesh, len(s)))
                    for s, dt in self.array_specs()) for _ in range(self.num_layers)]
        return kv + [tuple(sharding.zeros_sharded((self.num_state_slots,) + a.shape, a.dtype, spec)
                           for a, spec in zip(layer, specs))
                     for layer, specs in zip(self.state_arrays, self.state_shardings())]

    @property
    def kv_caches(self) -> list:
        """The KV tensors' caches (the first ``num_layers`` of `caches`; the state pools follow)."""
        return self.caches[:self.num_layers]

    def _set_kv(self, kv_caches) -> None:
        self.caches = list(kv_caches) + list(self.caches[self.num_layers:])

    def lost(self) -> bool:
        """Whether a failed step consumed the donated pool (then `reset` makes a new one)."""
        return any(x.is_deleted() for layer in self.caches for x in layer)

    def reset(self) -> None:
        self.caches = self.new_caches()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """All copy-on-write copies (src, dst) of one step, in one call."""
        if not copies:
            return
        src, dst = (padded_ids(list(ids), 4) for ids in zip(*copies))
        with jax.set_mesh(self.mesh):
            self._set_kv(self.counter.call("copy", self._copy, self.kv_caches, src, dst, num_fixed=1))

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """All recurrent-state copies (source slot, destination slot) of one step, in one call."""
        if not copies:
            return
        src, dst = (padded_ids(list(ids), 4) for ids in zip(*copies))
        with jax.set_mesh(self.mesh):
            states = self.counter.call("copy_states", self._copy_states, self.caches[self.num_layers:], src, dst,
                                       num_fixed=1)
        self.caches = list(self.kv_caches) + list(states)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copies device blocks into host blocks, (device, host) pairs (one device -> host transfer)."""
        if not pairs:
            return
        device, host = zip(*pairs)
        data = jax.device_get(self._gather(self.kv_caches, padded_ids(list(device), 4, fill=0)))
        if self.host is None:
            self.host = tuple(np.zeros(d.shape[:2] + (self.num_host_blocks,) + d.shape[3:], d.dtype) for d in data)
        for buffer, d in zip(self.host, data):  # each [L, Hkv, blocks, block_size, ...]
            buffer[:, :, list(host)] = d[:, :, :len(host)]

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copies host blocks into device blocks, (host, device) pairs (one host -> device transfer)."""
        if not pairs:
            return
        host, device = zip(*pairs)
        blocks = padded_ids(list(device), 4)
        data = []
        for buffer in self.host:
            d = buffer[:, :, list(host)]
            pad = np.zeros(d.shape[:2] + (len(blocks) - d.shape[2],) + d.shape[3:], d.dtype)
            data.append(np.concatenate([d, pad], axis=2))
        self._set_kv(self._scatter(self.kv_caches, blocks, tuple(data)))

    def read_blocks(self, blocks: list[int]):
        """Starts copying these device blocks to the host (asynchronously where the arrays can);
        returns a function that waits and gives each block's arrays, a tuple per block of
        ``[layers, kv_heads, block_size, ...]`` arrays (pages, then scale words). Dispatched before
        the step, the copy reads the blocks as they were before the step writes."""
        parts = []
        for chunk in _chunks(list(blocks)):
            ids = padded_ids(chunk, MIN_TRANSFER_BLOCKS, fill=0)
            data = self.counter.call("tier_gather", self._gather, self.kv_caches, ids, num_fixed=1)
            for array in data:
                if hasattr(array, "copy_to_host_async"):
                    array.copy_to_host_async()
            parts.append((len(chunk), data))

        def result() -> list[tuple[np.ndarray, ...]]:
            out = []
            for n, data in parts:
                arrays = [np.asarray(a) for a in data]
                out += [tuple(np.ascontiguousarray(a[:, :, i]) for a in arrays) for i in range(n)]
            return out
        return result

    def write_blocks(self, loads: list[tuple[int, tuple]]) -> None:
        """Writes block arrays (as `read_blocks` gives them) into device blocks, (block, arrays) pairs,
        one host -> device transfer per chunk."""
        for chunk in _chunks(list(loads)):
            blocks = padded_ids([b for b, _ in chunk], MIN_TRANSFER_BLOCKS)
            data = []
            for k in range(len(chunk[0][1])):
                d = np.stack([arrays[k] for _, arrays in chunk], axis=2)
                pad = np.zeros(d.shape[:2] + (len(blocks) - d.shape[2],) + d.shape[3:], d.dtype)
                data.append(np.concatenate([d, pad], axis=2))
            self._set_kv(self.counter.call("tier_scatter", self._scatter, self.kv_caches, blocks, tuple(data),
                                           num_fixed=1))

    def compile_transfers(self) -> None:
        """Compiles the tiers' gather and scatter for every count of `transfer_buckets`: a gather
        of block 0 and a scatter to no block (negative ids are dropped), so nothing changes."""
        for n in transfer_buckets(self.num_blocks):
            ids = np.zeros(n, np.int32)
            gathered = [np.asarray(a) for a in
                        self.counter.call("tier_gather", self._gather, self.kv_caches, ids, num_fixed=1)]
            self._set_kv(self.counter.call("tier_scatter", self._scatter, self.kv_caches, np.full(n, -1, np.int32),
                                           tuple(np.zeros_like(a) for a in gathered), num_fixed=1))
