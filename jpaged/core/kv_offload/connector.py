"""The connector between the device pool and the tiers: what moves each step, and the hit counts.

The device pool's prefix cache stays the first tier. Two hooks of `BlockPool` feed the connector:
``on_register`` (a full block became findable: its stable id is derived from its parent's) and
``on_evict`` (a cached free block is about to be reused: its K/V is queued to be stored). A prefix
lookup (`materialize`) looks past the device pool into the host tier, then the disk tier, by the
same block hashes; hits are loaded into free device blocks, registered there, and left free, so
admission revives them exactly as it revives device hits. Per step the scheduler takes the planned
moves (`take_moves`): stores run on the device before anything the step writes, loads right after.

Block hashes are Python hashes (the same only within a process), so the host tier is keyed by
them; the disk tier by a *stable id*: sha256 of the parent's stable id and the block's tokens, the
root's from the descriptor the KV cache manager names it by (salt, KV-cache group). A block whose
parent's stable id is unknown is kept in host memory only.
"""
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from jpaged.core.kv_offload.disk_tier import DiskTier
from jpaged.core.kv_offload.host_tier import BlockEntry, HostTier

MAX_STABLE_IDS = 1 << 20  # block hash -> stable id entries kept (a forgotten one is only a miss)
_NO_ROOM = object()


@dataclass(frozen=True)
class TierBlock:
    """A prefix block found in a tier, not on the device yet: its prefix-cache key."""

    key: tuple


def _leaves(found):
    for x in found:
        if isinstance(x, (list, tuple)) and not isinstance(x, TierBlock):
            yield from _leaves(x)
        else:
            yield x


def _substitute(found, mapping):
    if isinstance(found, TierBlock):
        return mapping[found.key]
    if isinstance(found, list):
        return [_substitute(x, mapping) for x in found]
    if isinstance(found, tuple):
        return tuple(_substitute(x, mapping) for x in found)
    return found


class TierStats:
    """Counters since start (blocks, bytes, seconds)."""

    def __init__(self):
        self.host_hits = self.disk_hits = 0
        self.host_loaded_bytes = self.disk_loaded_bytes = 0
        self.host_stored_bytes = self.disk_stored_bytes = 0
        self.load_seconds = 0.0


class KVOffload:
    def __init__(self, *, host_bytes: int, disk_path: str | None = None, disk_bytes: int = 0,
                 namespace: str = "default", block_size: int = 16):
        self.block_size = block_size
        self.host = HostTier(host_bytes)
        self.disk = DiskTier(disk_path, namespace, disk_bytes) if disk_path else None
        self.stable_ids: OrderedDict[int, str] = OrderedDict()  # block hash -> stable id
        self.root_ids: dict = {}  # root hash (None: no salt, group 0) -> stable id
        self.pending_stores: dict[int, tuple] = {}  # device block -> key, evicted this step
        self.pending_loads: dict[int, BlockEntry] = {}  # device block -> the entry loaded into it
        self.stats = TierStats()

    # Stable ids ---------------------------------------------------------------------------------------
    def name_root(self, root, descriptor: tuple) -> None:
        """``root``: a chain's first parent hash; ``descriptor``: what it was hashed from, in values
        whose repr is the same in every process."""
        if root not in self.root_ids:
            self.root_ids[root] = hashlib.sha256(repr(("root", descriptor)).encode()).hexdigest()[:32]

    def stable_id(self, key: tuple) -> str | None:
        block_hash, parent, tokens = key
        known = self.stable_ids.get(block_hash)
        if known is not None:
            self.stable_ids.move_to_end(block_hash)
            return known
        parent_id = self.root_ids.get(parent) if parent in self.root_ids else self.stable_ids.get(parent)
        if parent_id is None:
            return None
        stable = hashlib.sha256(f"{parent_id}:{list(tokens)}".encode()).hexdigest()[:32]
        self.stable_ids[block_hash] = stable
        if len(self.stable_ids) > MAX_STABLE_IDS:
            self.stable_ids.popitem(last=False)
        return stable

    # Pool hooks ---------------------------------------------------------------------------------------
    def on_register(self, key: tuple) -> None:
        self.stable_id(key)

    def on_evict(self, block: int, key: tuple) -> None:
        """A cached free block is about to be reused: store it unless a tier has it (or its load
        has not run yet: then the tier still has it)."""
        if self.pending_loads.pop(block, None) is not None:
            return
        if self.host.get(key) is not None:
            return
        stable = self.stable_id(key)
        if self.disk is not None and stable is not None and stable in self.disk:
            return
        self.pending_stores[block] = key

    # Lookup -------------------------------------------------------------------------------------------
    def contains(self, key: tuple) -> bool:
        if key[0] in self.host and self.host.entries[key[0]].key == key:
            return True
        if self.disk is None:
            return False
        stable = self.stable_id(key)
        return stable is not None and stable in self.disk

    def fetch(self, key: tuple) -> BlockEntry | None:
        """The entry of ``key`` from the host tier, else read from disk (then kept in host memory)."""
        entry = self.host.get(key)
        if entry is not None:
            self.stats.host_hits += 1
            self.stats.host_loaded_bytes += entry.nbytes
            return entry
        stable = self.stable_id(key)
        if self.disk is None or stable is None:
            return None
        start = time.perf_counter()
        data = self.disk.get(stable)
        self.stats.load_seconds += time.perf_counter() - start
        if data is None:
            return None
        entry = BlockEntry(key, stable, data)
        self.stats.disk_hits += 1
        self.stats.disk_loaded_bytes += entry.nbytes
        self._keep(entry, to_host=True)
        return entry

    def materialize(self, pool, lookup):
        """``lookup(use_tiers)``: a prefix lookup's result (lists and tuples of device block ids,
        with `TierBlock`s where only a tier has the block). Returns it with the tier blocks loaded
        into free device blocks (registered, free, their loads queued), or, when the pool has too
        few free blocks for them, the device-only lookup."""
        for _ in range(16):  # each failed read drops a bad file, so the next lookup is shorter
            found = lookup(True)
            tier = list(dict.fromkeys(x.key for x in _leaves(found) if isinstance(x, TierBlock)))
            if not tier:
                return found
            device = {x for x in _leaves(found) if isinstance(x, int) and x >= 0}
            mapping = self._load(pool, device, tier)
            if mapping is _NO_ROOM:
                break
            if mapping is not None:
                return _substitute(found, mapping)
        return lookup(False)

    def _load(self, pool, device: set[int], keys: list[tuple]):
        entries = []
        for key in keys:
            entry = self.fetch(key)
            if entry is None:
                return None
            entries.append(entry)
        pinned = sorted(device)
        for block in pinned:  # no load may evict a device block of the same hit
            pool.incref(block)
        taken = []
        try:
            if len(entries) > pool.num_free_blocks:
                return _NO_ROOM
            mapping = {}
            for entry in entries:
                block = pool.allocate()
                taken.append(block)
                pool.register(block, *entry.key)
                self.pending_loads[block] = entry
                mapping[entry.key] = block
            return mapping
        finally:
            for block in pinned + taken:
                pool.decref(block)

    # Moves --------------------------------------------------------------------------------------------
    def take_moves(self) -> tuple[list[tuple[int, tuple]], list[tuple[int, tuple]]]:
        """This step's stores ``(device block, key)`` and loads ``(device block, block arrays)``."""
        stores, loads = list(self.pending_stores.items()), [(b, e.data) for b, e in self.pending_loads.items()]
        self.pending_stores.clear()
        self.pending_loads.clear()
        return stores, loads

    def drop_pending(self) -> None:
        """Forgets planned moves (the step that carried them failed, or the pool was rebuilt)."""
        self.pending_stores.clear()
        self.pending_loads.clear()

    def store(self, keys: list[tuple], blocks: list[tuple]) -> None:
        """Keeps the evicted blocks' arrays (one tuple per key) in the host tier; what the host
        tier drops goes to disk."""
        for key, data in zip(keys, blocks):
            self._keep(BlockEntry(key, self.stable_id(key), data), to_host=True)

    def _keep(self, entry: BlockEntry, to_host: bool) -> None:
        dropped = self.host.put(entry) if to_host else [entry]
        if not any(victim is entry for victim in dropped):
            self.stats.host_stored_bytes += entry.nbytes
        for victim in dropped:
            if self.disk is not None and victim.stable_id is not None:
                self.stats.disk_stored_bytes += self.disk.put(victim.stable_id, victim.data)

    def note_load_seconds(self, seconds: float) -> None:
        self.stats.load_seconds += seconds

    # Metrics ------------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        s, bs = self.stats, self.block_size
        return {
            "kv_offload_host_hits": s.host_hits * bs,  # tokens, as prefix_cache_hits
            "kv_offload_disk_hits": s.disk_hits * bs,
            "kv_offload_host_loaded_bytes": s.host_loaded_bytes,
            "kv_offload_disk_loaded_bytes": s.disk_loaded_bytes,
            "kv_offload_host_stored_bytes": s.host_stored_bytes,
            "kv_offload_disk_stored_bytes": s.disk_stored_bytes,
            "kv_offload_host_used_bytes": self.host.used_bytes,
            "kv_offload_disk_used_bytes": 0 if self.disk is None else self.disk.used_bytes,
            "kv_offload_load_seconds": s.load_seconds,
        }
