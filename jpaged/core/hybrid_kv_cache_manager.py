"""The KV cache of a model with several KV-cache groups (`kv_cache_layout`): one `KVCacheManager`
per group, all taking blocks from one `BlockPool` (vLLM's hybrid KV cache manager).

Each group keeps its own block table per sequence: a global group every block of the sequence, a
windowed group only those its window still reaches (the rest are `NULL_BLOCK`), so the pool holds
at most ``window / block_size + 1`` blocks per sequence for a windowed group in decode, and a
prompt chunk's blocks besides while it is computed. Allocation is all or nothing over the groups:
the blocks every group needs are counted against the shared pool before any group takes one.

A prefix-cache hit must hold in every group: the groups' keys are kept apart, a global group needs
every block of the prefix and a windowed one those in the window of the first new token; the hit
is the longest prefix all groups (and all of a request's new sequences) have. Cached blocks come
as one tuple per block (an id per group, `NULL_BLOCK` where a windowed group needs none).
"""
from jpaged.core.block_pool import BlockPool
from jpaged.core.kv_cache_layout import KVCacheLayout
from jpaged.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from jpaged.core.request import Sequence


class HybridKVCacheManager:
    def __init__(self, layout: KVCacheLayout, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 share_forked_blocks: bool = True):
        self.layout, self.block_size = layout, block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = [KVCacheManager(num_blocks, block_size, enable_prefix_caching, share_forked_blocks,
                                      sliding_window=window, pool=self.pool, group=g)
                       for g, window in enumerate(layout.group_windows)]

    @property
    def block_tables(self) -> dict[int, list[int]]:
        """Group 0's tables, by seq_id (every group has a table for the same sequences)."""
        return self.groups[0].block_tables

    @property
    def prefix_cache_queries(self) -> int:
        return self.groups[0].prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.groups[0].prefix_cache_hits

    def block_table(self, seq: Sequence) -> list[int]:
        return self.groups[0].block_table(seq)

    def set_weights_version(self, version: int) -> None:
        for group in self.groups:
            group.set_weights_version(version)

    def group_block_tables(self, seq: Sequence) -> list[list[int]]:
        """The tables of groups 1, 2, ... (group 0's is `block_table`)."""
        return [group.block_table(seq) for group in self.groups[1:]]

    # Allocation ---------------------------------------------------------------------------------------
    def _per_group(self, cached_blocks):
        """Group g's cached blocks of each sequence, from one tuple per block."""
        if cached_blocks is None:
            return [None] * len(self.groups)
        return [[[bundle[g] for bundle in blocks] for blocks in cached_blocks] for g in range(len(self.groups))]

    def allocate_slots(self, seqs: list[Sequence], num_new_tokens: int, cached_blocks: list | None = None,
                       cache_salt: str | None = None) -> list[list[int]] | None:
        """`KVCacheManager.allocate_slots` in every group, all or nothing over the groups."""
        per_group = self._per_group(cached_blocks)
        computed = [s.num_computed_tokens for s in seqs]
        need = sum(group.blocks_needed(seqs, num_new_tokens, cached) for group, cached in zip(self.groups, per_group))
        if need > self.pool.num_free_blocks:
            return None
        if cached_blocks is not None:  # every group revives its cached blocks before any group takes a
            for group, cached in zip(self.groups, per_group):  # new one, which could evict them
                for seq, n in zip(seqs, computed):  # each group admits the sequences afresh
                    seq.num_computed_tokens = n
                group.admit(seqs, cached, cache_salt)
        for group in self.groups:  # the blocks windows release count toward what the others take
            group.release_behind_windows(seqs)
        new_blocks = [[] for _ in seqs]
        for group in self.groups:
            for blocks, new in zip(new_blocks, group.take_slots(seqs, num_new_tokens, None, cache_salt)):
                blocks += new
        return new_blocks

    def reserve_slots(self, seqs: list[Sequence], num_new_tokens: int) -> bool:
        if (sum(group.blocks_needed(seqs, num_new_tokens, copy_on_write=False) for group in self.groups)
                > self.pool.num_free_blocks):
            return False
        for group in self.groups:
            group.release_behind_windows(seqs)
        for group in self.groups:
            group.take_reserved(seqs, num_new_tokens)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for group in self.groups:
            group.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        for group in self.groups:
            group.free(seq)

    def free_blocks_past(self, seq: Sequence, num_tokens: int) -> None:
        for group in self.groups:
            group.free_blocks_past(seq, num_tokens)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return [copy for group in self.groups for copy in group.take_pending_copies()]

    # Prefix caching -------------------------------------------------------------------------------------
    def find_cached_prefix(self, seqs: list[Sequence], cache_salt: str | None = None) -> list[list[tuple]]:
        """The longest prefix cached in every group for every sequence: per sequence, one tuple of
        block ids (one per group) per cached block."""
        if not self.enable_prefix_caching:
            return [[] for _ in seqs]
        limit = min((s.num_tokens - 1) // self.block_size for s in seqs)
        while True:
            found = [[group.find_cached_blocks(s, cache_salt, limit) for group in self.groups] for s in seqs]
            shortest = min(len(blocks) for per_seq in found for blocks in per_seq)
            if all(len(blocks) == shortest for per_seq in found for blocks in per_seq):
                return [list(zip(*per_seq)) for per_seq in found]
            limit = shortest

    # Metrics --------------------------------------------------------------------------------------------
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def utilization(self, seqs: list[Sequence]) -> float:
        filled: dict[int, int] = {}
        for group in self.groups:
            group.filled_slots(seqs, filled)
        return sum(filled.values()) / (len(filled) * self.block_size) if filled else 0.0
