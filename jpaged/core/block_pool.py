"""A fixed pool of KV block ids: free queue, reference counts, and the prefix-cache index.

A block is *used* while its reference count is positive. A freed block goes to the back of the
free queue but keeps its content hash, so a later request with the same prefix can still find and
revive it; blocks are reused (and their hash forgotten) from the front of the queue, so the least
recently freed cached block is evicted first.

With prefix-cache tiers (`jpaged.core.kv_offload`), ``offload`` hears of every registered block
(``on_register``) and of every cached block about to be reused (``on_evict``, before its key is
forgotten), so its K/V can be kept in host memory or on disk.
"""
from collections import OrderedDict


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_key: list[tuple | None] = [None] * num_blocks  # (hash, parent hash, tokens)
        self.cached: dict[int, int] = {}  # content hash -> block id
        self.offload = None  # a `KVOffload`, or None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self) -> int:
        """Takes the least recently freed block; forgets whatever it cached."""
        if not self.free_queue:
            raise NoFreeBlocksError("the KV block pool is exhausted")
        block, _ = self.free_queue.popitem(last=False)
        if self.offload is not None and self.block_key[block] is not None:
            self.offload.on_evict(block, self.block_key[block])
        self._forget(block)
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]  # a cached free block comes back to life
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} freed twice")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None

    # Prefix cache -----------------------------------------------------------------------------
    def lookup(self, block_hash: int, parent_hash: int | None, tokens: tuple) -> int | None:
        """A block holding exactly these tokens after this parent, or None."""
        block = self.cached.get(block_hash)
        if block is not None and self.block_key[block] == (block_hash, parent_hash, tokens):
            return block
        return None

    def register(self, block: int, block_hash: int, parent_hash: int | None, tokens: tuple) -> None:
        """Makes a full, computed block findable by its content hash."""
        if self.offload is not None:
            self.offload.on_register((block_hash, parent_hash, tokens))
        if self.block_key[block] is not None or block_hash in self.cached:
            return  # already cached (here or as an identical block elsewhere)
        self.block_key[block] = (block_hash, parent_hash, tokens)
        self.cached[block_hash] = block

    def _forget(self, block: int) -> None:
        key = self.block_key[block]
        if key is not None:
            if self.cached.get(key[0]) == block:
                del self.cached[key[0]]
            self.block_key[block] = None

    def forget_free_blocks(self) -> None:
        """Drops the prefix-cache entries of every free block (their contents are not trusted)."""
        for block in self.free_queue:
            self._forget(block)

    def check_invariants(self) -> None:
        """For tests: every block is either free with ref 0 or used with ref > 0."""
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has ref count {rc}"
            assert (rc == 0) == (b in self.free_queue), f"block {b}: ref {rc} vs free queue"
        for h, b in self.cached.items():
            assert self.block_key[b][0] == h
