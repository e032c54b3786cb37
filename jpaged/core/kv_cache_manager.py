"""Block tables per sequence: allocate as tokens arrive, share by fork, copy on write, free.

Nothing here touches the device. Copies that copy-on-write decides on are queued in
``pending_copies``; the scheduler hands them to the model runner with the step that needs them,
which sends them to the device in one batched ``copy_blocks`` call.

Two calls make up admission: ``find_cached_blocks`` (pure: which cached blocks a new sequence
could reuse) and ``allocate_slots`` (atomic: takes the cached blocks and every new block a step
needs, for all of a request's sequences, or changes nothing and returns None).
"""
from typing import Protocol

from jpaged.core.block_pool import BlockPool
from jpaged.core.request import Sequence
from jpaged.utils import cdiv


class KVCache(Protocol):
    """What the scheduler and the engine need from a KV cache manager (paged, or the paper's
    contiguous-reservation baselines in `reservation.py`)."""

    block_size: int
    pool: object
    prefix_cache_queries: int
    prefix_cache_hits: int

    def block_table(self, seq: Sequence) -> list[int]: ...

    def find_cached_blocks(self, seq: Sequence, cache_salt: str | None) -> list[int]: ...

    def allocate_slots(self, seqs: list[Sequence], num_new_tokens: int,
                       cached_blocks: list[list[int]] | None = None,
                       cache_salt: str | None = None) -> list[list[int]] | None: ...

    def reserve_slots(self, seqs: list[Sequence], num_new_tokens: int) -> bool: ...

    def fork(self, parent: Sequence, child: Sequence) -> None: ...

    def free(self, seq: Sequence) -> None: ...

    def free_blocks_past(self, seq: Sequence, num_tokens: int) -> None: ...

    def take_pending_copies(self) -> list[tuple[int, int]]: ...

    def usage(self) -> float: ...

    def utilization(self, seqs: list[Sequence]) -> float: ...


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 share_forked_blocks: bool = True):
        self.block_size = block_size
        self.share_forked_blocks = share_forked_blocks  # False: forks copy every block (to measure sharing)
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[int, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src block, dst block)
        self.prefix_cache_queries = 0  # prompt tokens of admitted sequences
        self.prefix_cache_hits = 0     # of those, tokens found in the cache

    def block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables.get(seq.seq_id, [])

    # Allocation ---------------------------------------------------------------------------------
    def allocate_slots(self, seqs: list[Sequence], num_new_tokens: int,
                       cached_blocks: list[list[int]] | None = None,
                       cache_salt: str | None = None) -> list[list[int]] | None:
        """Makes each sequence's table cover its next ``num_new_tokens`` slots, all or nothing.

        ``cached_blocks`` (admission only, one list per sequence, from `find_cached_blocks`) become
        the start of the tables; the sequences then count them as computed. A shared, partly
        filled block about to be written is replaced by a copy (copy-on-write, queued). Blocks that
        will be full once the step has run are registered in the prefix cache. Returns the newly
        allocated blocks per sequence, or None (nothing changed) when the pool is short.
        """
        admitting = cached_blocks is not None
        cached_blocks = cached_blocks or [[] for _ in seqs]
        reviving = {b for blocks in cached_blocks for b in blocks if self.pool.ref_counts[b] == 0}
        need = sum(self._num_new_blocks(s, len(c) * self.block_size, num_new_tokens)
                   for s, c in zip(seqs, cached_blocks))
        if need + len(reviving) > self.pool.num_free_blocks:
            return None
        if admitting:  # every cached block is taken before any new one, which could evict it
            for seq, cached in zip(seqs, cached_blocks):
                self._admit(seq, cached)
        new_blocks = []
        for seq in seqs:
            new_blocks.append(self._grow(seq, num_new_tokens))
            self._cache_full_blocks(seq, cache_salt, seq.num_computed_tokens + num_new_tokens)
        return new_blocks

    def reserve_slots(self, seqs: list[Sequence], num_new_tokens: int) -> bool:
        """Grows each table to cover its next ``num_new_tokens`` slots, all or nothing, for tokens
        not sampled yet (a decode window): nothing is registered in the prefix cache (the next
        `allocate_slots` registers the blocks once their tokens are known), and no block is copied
        (the step's own slots, allocated first, are the only ones that can be in a shared block:
        a full block the step writes may already be shared by a prefix-cache hit of this step).
        """
        need = sum(max(0, cdiv(s.num_computed_tokens + num_new_tokens, self.block_size) - len(self.block_table(s)))
                   for s in seqs)
        if need > self.pool.num_free_blocks:
            return False
        for seq in seqs:
            self._grow(seq, num_new_tokens, copy_on_write=False)
        return True

    def _num_new_blocks(self, seq: Sequence, num_cached_tokens: int, num_new_tokens: int) -> int:
        computed = seq.num_computed_tokens + num_cached_tokens
        table_len = len(self.block_table(seq)) + num_cached_tokens // self.block_size
        need = cdiv(computed + num_new_tokens, self.block_size) - table_len
        if not num_cached_tokens and self._shared_block_written(seq, num_new_tokens) is not None:
            need += 1
        return max(need, 0)

    def _admit(self, seq: Sequence, cached: list[int]) -> None:
        """A sequence with nothing computed starts from its cached blocks (maybe none)."""
        assert seq.num_computed_tokens == 0 and not self.block_table(seq)
        for block in cached:
            self.pool.incref(block)
        self.block_tables[seq.seq_id] = list(cached)
        seq.block_hashes = [self.pool.block_key[b][0] for b in cached]
        seq.num_computed_tokens = len(cached) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed_tokens

    def _grow(self, seq: Sequence, num_new_tokens: int, copy_on_write: bool = True) -> list[int]:
        table = self.block_tables.setdefault(seq.seq_id, [])
        new = []
        shared = self._shared_block_written(seq, num_new_tokens) if copy_on_write else None
        if shared is not None:  # copy-on-write: the last writer keeps the original
            src, dst = table[shared], self.pool.allocate()
            self.pending_copies.append((src, dst))
            self.pool.decref(src)
            table[shared] = dst
            new.append(dst)
        while len(table) < cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size):
            table.append(self.pool.allocate())
            new.append(table[-1])
        return new

    def _shared_block_written(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Index of a partly filled block that is shared and about to be written, if any."""
        table = self.block_table(seq)
        first = seq.num_computed_tokens // self.block_size
        if num_new_tokens > 0 and first < len(table) and self.pool.ref_counts[table[first]] > 1:
            return first
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (reference counts go up)."""
        table = list(self.block_table(parent))
        if not self.share_forked_blocks:
            if len(table) > self.pool.num_free_blocks:
                raise RuntimeError("share_forked_blocks=False: no room to copy a forked sequence's blocks")
            copies = [(block, self.pool.allocate()) for block in table]
            self.pending_copies += copies
            self.block_tables[child.seq_id] = [dst for _, dst in copies]
            return
        for block in table:
            self.pool.incref(block)
        self.block_tables[child.seq_id] = table

    def free(self, seq: Sequence) -> None:
        """Returns the sequence's blocks, tail first, so a prefix outlives its tail in the cache."""
        for block in reversed(self.block_tables.pop(seq.seq_id, [])):
            self.pool.decref(block)
        seq.block_hashes = []

    def free_blocks_past(self, seq: Sequence, num_tokens: int) -> None:
        """Keeps the blocks that hold the sequence's first ``num_tokens`` slots and returns the rest,
        last first: blocks reserved for proposals that were rejected (speculative decoding)."""
        table = self.block_tables.get(seq.seq_id, [])
        keep = cdiv(num_tokens, self.block_size)
        while len(table) > keep:
            self.pool.decref(table.pop())

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # Prefix caching -------------------------------------------------------------------------------
    def _root_hash(self, cache_salt: str | None) -> int | None:
        return None if cache_salt is None else hash(("salt", cache_salt))

    def find_cached_blocks(self, seq: Sequence, cache_salt: str | None = None) -> list[int]:
        """The longest run of cached full blocks that starts this sequence's tokens (changes nothing).

        The last token is always recomputed (its logits are needed), so at most
        ``(num_tokens - 1) // block_size`` blocks are found.
        """
        if not self.enable_prefix_caching:
            return []
        bs, tokens = self.block_size, seq.token_ids
        parent = self._root_hash(cache_salt)
        blocks = []
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            block_hash = hash((parent, chunk))
            block = self.pool.lookup(block_hash, parent, chunk)
            if block is None:
                break
            blocks.append(block)
            parent = block_hash
        return blocks

    def _cache_full_blocks(self, seq: Sequence, cache_salt: str | None, num_tokens: int) -> None:
        """Registers the blocks that hold ``num_tokens`` tokens once this step has run.

        Registering at schedule time is safe: a request that reuses such a block in the same step
        reads it only after the step's layer has written it (each layer writes the K/V of every
        token in the batch before any of them attends).
        """
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, self.block_table(seq)
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else self._root_hash(cache_salt)
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block_hash = hash((parent, chunk))
            self.pool.register(table[i], block_hash, parent, chunk)
            seq.block_hashes.append(block_hash)

    # Metrics ----------------------------------------------------------------------------------------
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def utilization(self, seqs: list[Sequence]) -> float:
        """Token slots holding tokens / slots in allocated blocks (shared blocks counted once)."""
        filled: dict[int, int] = {}
        for seq in seqs:
            table = self.block_table(seq)
            for i, block in enumerate(table):
                n = min(self.block_size, max(0, seq.num_computed_tokens - i * self.block_size))
                filled[block] = max(filled.get(block, 0), n)
        if not filled:
            return 0.0
        return sum(filled.values()) / (len(filled) * self.block_size)
