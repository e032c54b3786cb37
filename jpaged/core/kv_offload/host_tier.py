"""The host tier: full prefix-cache blocks in host memory, least recently used dropped first."""
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class BlockEntry:
    """One block's K/V of every layer: ``key`` is the prefix-cache key ``(block hash, parent
    hash, tokens)``, ``stable_id`` its digest that is the same in every process (None: unknown, the
    block is not written to disk), ``data`` one array per pool array of a layer, each
    ``[layers, kv_heads, block_size, ...]`` (K pages, V pages, then scale words of 8-bit pages)."""

    key: tuple
    stable_id: str | None
    data: tuple[np.ndarray, ...]

    @property
    def block_hash(self) -> int:
        return self.key[0]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.data)


class HostTier:
    """Blocks by block hash within ``capacity_bytes``; `put` returns what it dropped."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[int, BlockEntry] = OrderedDict()
        self.used_bytes = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.entries

    def get(self, key: tuple) -> BlockEntry | None:
        """The entry of exactly this key (most recently used now), or None."""
        entry = self.entries.get(key[0])
        if entry is None or entry.key != key:
            return None
        self.entries.move_to_end(key[0])
        return entry

    def put(self, entry: BlockEntry) -> list[BlockEntry]:
        """Keeps ``entry`` (unless it alone exceeds the capacity); returns the entries dropped to
        make room (least recently used first), ``entry`` itself when it does not fit."""
        if entry.nbytes > self.capacity_bytes:
            return [entry]
        old = self.entries.pop(entry.block_hash, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        self.entries[entry.block_hash] = entry
        self.used_bytes += entry.nbytes
        dropped = []
        while self.used_bytes > self.capacity_bytes:
            _, victim = self.entries.popitem(last=False)
            self.used_bytes -= victim.nbytes
            dropped.append(victim)
        return dropped
