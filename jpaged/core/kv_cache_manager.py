"""Block tables per sequence: allocate as tokens arrive, share by fork, copy on write, free.

Nothing here touches the device. Copies that copy-on-write decides on are queued in
``pending_copies``; the scheduler hands them to the model runner with the step that needs them,
which sends them to the device in one batched ``copy_blocks`` call.

Two calls make up admission: ``find_cached_prefix`` (which cached blocks a request's new
sequences could reuse; pure without tiers) and ``allocate_slots`` (atomic: takes the cached blocks and every new block
a step needs, for all of a request's sequences, or changes nothing and returns None).

Sliding windows: a manager whose layers all attend through a window of ``sliding_window`` keys
releases the blocks every query has left behind. Before a step that starts at position p, the
blocks wholly before ``p - sliding_window + 1`` go back to the pool and their table entries become
`NULL_BLOCK` (the attention never reads them: `pallas_kernels` start at the window's first block);
the table keeps its length, so block i still holds positions ``i * block_size ...``. A prefix-cache
hit then needs only the blocks in the window of the first new token (a cached prefix whose window
blocks were evicted is a shorter hit, never a wrong one). `HybridKVCacheManager` runs one of these
per KV-cache group over one shared pool.

Prefix-cache tiers (``offload``, a `jpaged.core.kv_offload.KVOffload` set on the pool): a lookup
that misses in the pool asks the tiers by the same keys; their hits are loaded into free device
blocks before admission takes them (`KVOffload.materialize`), so they count as cached tokens.
"""
import os
from collections import Counter
from typing import Protocol

from jpaged.core.block_pool import BlockPool
from jpaged.core.kv_offload import TierBlock
from jpaged.core.request import Sequence
from jpaged.utils import cdiv

_PROCESS_NONCE = os.urandom(8).hex()  # names the disk-tier entries of weights updated in this process

# the first parent of an unsalted hash chain: an int, so that the chain is the same in every process
# (before Python 3.12 hash(None) is None's address, different in each; the router and a multi-host
# engine's processes compute the same chains)
UNSALTED_ROOT = 0
NULL_BLOCK = -1  # a table entry a window has released (the runner sends block 0, never read)


class KVCache(Protocol):
    """What the scheduler and the engine need from a KV cache manager (paged, or the paper's
    contiguous-reservation baselines in `reservation.py`)."""

    block_size: int
    pool: object
    prefix_cache_queries: int
    prefix_cache_hits: int

    def block_table(self, seq: Sequence) -> list[int]: ...

    def group_block_tables(self, seq: Sequence) -> list[list[int]]: ...

    def find_cached_prefix(self, seqs: list[Sequence], cache_salt: str | None) -> list: ...

    def set_weights_version(self, version: int) -> None: ...

    def allocate_slots(self, seqs: list[Sequence], num_new_tokens: int,
                       cached_blocks: list | None = None,
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
                 share_forked_blocks: bool = True, *, sliding_window: int | None = None,
                 pool: BlockPool | None = None, group: int = 0):
        """``sliding_window``: the window of every layer this manager serves (None: global).
        ``pool``, ``group``: a pool shared with the managers of other KV-cache groups, and this
        one's index (which keeps its prefix-cache keys apart from theirs)."""
        self.block_size = block_size
        self.share_forked_blocks = share_forked_blocks  # False: forks copy every block (to measure sharing)
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window, self.group = sliding_window, group
        self.block_tables: dict[int, list[int]] = {}
        self.block_hashes: dict[int, list[int]] = {}  # seq_id -> prefix-cache keys of its full blocks
        self.pending_copies: list[tuple[int, int]] = []  # (src block, dst block)
        self.prefix_cache_queries = 0  # prompt tokens of admitted sequences
        self.prefix_cache_hits = 0     # of those, tokens found in the cache
        self.weights_version = 0       # in every block's key: a cached block never outlives its weights

    def block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables.get(seq.seq_id, [])

    def group_block_tables(self, seq: Sequence) -> list[list[int]]:
        """The tables of the other KV-cache groups (none: this manager is the only one)."""
        return []

    # Allocation ---------------------------------------------------------------------------------
    def allocate_slots(self, seqs: list[Sequence], num_new_tokens: int,
                       cached_blocks: list[list[int]] | None = None,
                       cache_salt: str | None = None) -> list[list[int]] | None:
        """Makes each sequence's table cover its next ``num_new_tokens`` slots, all or nothing.

        ``cached_blocks`` (admission only, one list per sequence, from `find_cached_prefix`) become
        the start of the tables; the sequences then count them as computed. A shared, partly
        filled block about to be written is replaced by a copy (copy-on-write, queued). Blocks that
        will be full once the step has run are registered in the prefix cache; blocks behind a
        window are released. Returns the newly allocated blocks per sequence, or None (nothing
        changed) when the pool is short.
        """
        if self.blocks_needed(seqs, num_new_tokens, cached_blocks) > self.pool.num_free_blocks:
            return None
        return self.take_slots(seqs, num_new_tokens, cached_blocks, cache_salt)

    def blocks_needed(self, seqs: list[Sequence], num_new_tokens: int,
                      cached_blocks: list[list[int]] | None = None, copy_on_write: bool = True) -> int:
        """Free blocks `take_slots` (``copy_on_write=False``: `take_reserved`) would consume: new
        blocks and revived cached ones, less those the window releases."""
        cached_blocks = cached_blocks or [[] for _ in seqs]
        reviving = {b for blocks in cached_blocks for b in blocks if b != NULL_BLOCK and self.pool.ref_counts[b] == 0}
        need = sum(self._num_new_blocks(s, len(c) * self.block_size, num_new_tokens, copy_on_write)
                   for s, c in zip(seqs, cached_blocks))
        released = Counter(b for s in seqs for b in self._behind_window(s))
        return need + len(reviving) - sum(self.pool.ref_counts[b] == n for b, n in released.items())

    def take_slots(self, seqs: list[Sequence], num_new_tokens: int, cached_blocks: list[list[int]] | None = None,
                   cache_salt: str | None = None) -> list[list[int]]:
        """`allocate_slots` once `blocks_needed` fits the pool."""
        if cached_blocks is not None:  # every cached block is taken before any new one, which could evict it
            self.admit(seqs, cached_blocks, cache_salt)
        for seq in seqs:
            self._release_behind_window(seq)
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
        if self.blocks_needed(seqs, num_new_tokens, copy_on_write=False) > self.pool.num_free_blocks:
            return False
        self.take_reserved(seqs, num_new_tokens)
        return True

    def take_reserved(self, seqs: list[Sequence], num_new_tokens: int) -> None:
        """`reserve_slots` once `blocks_needed` fits the pool."""
        for seq in seqs:
            self._release_behind_window(seq)
            self._grow(seq, num_new_tokens, copy_on_write=False)

    def _first_needed(self, num_computed_tokens: int) -> int:
        """The first block a step that starts at ``num_computed_tokens`` reads (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _behind_window(self, seq: Sequence) -> list[int]:
        """The blocks of the table that the next step's window has left behind."""
        table = self.block_table(seq)
        return [b for b in table[:self._first_needed(seq.num_computed_tokens)] if b != NULL_BLOCK]

    def release_behind_windows(self, seqs: list[Sequence]) -> None:
        """Returns the blocks these sequences' window has left behind (`take_slots` and
        `take_reserved` do it first; a manager sharing its pool releases in all before any grows)."""
        for seq in seqs:
            self._release_behind_window(seq)

    def _release_behind_window(self, seq: Sequence) -> None:
        table = self.block_table(seq)
        for i in range(min(self._first_needed(seq.num_computed_tokens), len(table))):
            if table[i] != NULL_BLOCK:
                self.pool.decref(table[i])
                table[i] = NULL_BLOCK

    def _num_new_blocks(self, seq: Sequence, num_cached_tokens: int, num_new_tokens: int,
                        copy_on_write: bool = True) -> int:
        computed = seq.num_computed_tokens + num_cached_tokens
        table_len = len(self.block_table(seq)) + num_cached_tokens // self.block_size
        need = cdiv(computed + num_new_tokens, self.block_size) - max(table_len, self._first_needed(computed))
        if copy_on_write and not num_cached_tokens and self._shared_block_written(seq, num_new_tokens) is not None:
            need += 1
        return max(need, 0)

    def admit(self, seqs: list[Sequence], cached_blocks: list[list[int]], cache_salt: str | None = None) -> None:
        """Sequences with nothing computed start from their cached blocks (`take_slots`'s first part:
        a manager sharing its pool with others admits in all of them before any allocates)."""
        for seq, cached in zip(seqs, cached_blocks):
            self._admit(seq, cached, cache_salt)

    def _admit(self, seq: Sequence, cached: list[int], cache_salt: str | None) -> None:
        """A sequence with nothing computed starts from its cached blocks (maybe none)."""
        assert seq.num_computed_tokens == 0 and not self.block_table(seq)
        for block in cached:
            if block != NULL_BLOCK:
                self.pool.incref(block)
        self.block_tables[seq.seq_id] = list(cached)
        self.block_hashes[seq.seq_id] = self._hash_chain(seq, cache_salt, len(cached))
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
        first = self._first_needed(seq.num_computed_tokens)
        while len(table) < cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size):
            if len(table) < first:  # a resumed sequence: nothing before its window comes back
                table.append(NULL_BLOCK)
                continue
            table.append(self.pool.allocate())
            new.append(table[-1])
        return new

    def _shared_block_written(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Index of a partly filled block that is shared and about to be written, if any."""
        table = self.block_table(seq)
        first = seq.num_computed_tokens // self.block_size
        if (num_new_tokens > 0 and first < len(table) and table[first] != NULL_BLOCK
                and self.pool.ref_counts[table[first]] > 1):
            return first
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (reference counts go up)."""
        table = list(self.block_table(parent))
        self.block_hashes[child.seq_id] = list(self.block_hashes.get(parent.seq_id, []))
        if not self.share_forked_blocks:
            real = [b for b in table if b != NULL_BLOCK]
            if len(real) > self.pool.num_free_blocks:
                raise RuntimeError("share_forked_blocks=False: no room to copy a forked sequence's blocks")
            copies = {block: self.pool.allocate() for block in real}
            self.pending_copies += list(copies.items())
            self.block_tables[child.seq_id] = [copies.get(b, NULL_BLOCK) for b in table]
            return
        for block in table:
            if block != NULL_BLOCK:
                self.pool.incref(block)
        self.block_tables[child.seq_id] = table

    def free(self, seq: Sequence) -> None:
        """Returns the sequence's blocks, tail first, so a prefix outlives its tail in the cache."""
        for block in reversed(self.block_tables.pop(seq.seq_id, [])):
            if block != NULL_BLOCK:
                self.pool.decref(block)
        self.block_hashes.pop(seq.seq_id, None)

    def free_blocks_past(self, seq: Sequence, num_tokens: int) -> None:
        """Keeps the blocks that hold the sequence's first ``num_tokens`` slots and returns the rest,
        last first: blocks reserved for proposals that were rejected (speculative decoding)."""
        table = self.block_tables.get(seq.seq_id, [])
        keep = cdiv(num_tokens, self.block_size)
        while len(table) > keep:
            block = table.pop()
            if block != NULL_BLOCK:
                self.pool.decref(block)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # Prefix caching -------------------------------------------------------------------------------
    def set_weights_version(self, version: int) -> None:
        """New weights: blocks computed with the old ones never match again (the version is part
        of every key), and the free ones are forgotten now."""
        self.weights_version = version
        self.pool.forget_free_blocks()

    def _extra_keys(self) -> tuple:
        """What, besides the tokens, a block's contents depend on engine-wide (the weights' version);
        part of the root of every hash chain, with the request's ``cache_salt``."""
        return ("weights_version", self.weights_version) if self.weights_version else ()

    def _root_hash(self, cache_salt: str | None) -> int:
        root = UNSALTED_ROOT if cache_salt is None else hash(("salt", cache_salt))
        extra = self._extra_keys()
        if extra:
            root = hash((root, extra))
        root = root if self.group == 0 else hash(("kv_cache_group", self.group, root))
        if self.pool.offload is not None:  # what the root was hashed from, for the disk tier's ids
            # updated weights are this process's own: their disk entries must never match another's
            weights = (extra, _PROCESS_NONCE) if extra else ()
            self.pool.offload.name_root(root, (cache_salt, self.group, *weights))
        return root

    def _hash_chain(self, seq: Sequence, cache_salt: str | None, num_blocks: int) -> list[int]:
        """The prefix-cache keys of the sequence's first ``num_blocks`` full blocks."""
        bs, parent, keys = self.block_size, self._root_hash(cache_salt), []
        for i in range(num_blocks):
            parent = hash((parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
            keys.append(parent)
        return keys

    def find_cached_blocks(self, seq: Sequence, cache_salt: str | None = None,
                           max_blocks: int | None = None, use_tiers: bool = False) -> list[int]:
        """The longest cached prefix of this sequence's tokens, at most ``max_blocks`` blocks, as the
        table that would start from it (changes nothing). Globally attending layers need every
        block of it; windowed ones only those the first new token's window reaches (the others
        are `NULL_BLOCK`).

        The last token is always recomputed (its logits are needed), so at most
        ``(num_tokens - 1) // block_size`` blocks are found.
        """
        if not self.enable_prefix_caching:
            return []
        bs, tokens = self.block_size, seq.token_ids
        limit = (len(tokens) - 1) // bs if max_blocks is None else min(max_blocks, (len(tokens) - 1) // bs)
        parent, found = self._root_hash(cache_salt), []
        for i in range(limit):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            block_hash = hash((parent, chunk))
            found.append(self.pool.lookup(block_hash, parent, chunk))
            if found[-1] is None and use_tiers and self.pool.offload.contains((block_hash, parent, chunk)):
                found[-1] = TierBlock((block_hash, parent, chunk))  # `find_cached_prefix` loads it
            if found[-1] is None and self.sliding_window is None:
                break
            parent = block_hash
        hit = len(found)
        while hit and not all(b is not None for b in found[self._first_needed(hit * bs):hit]):
            hit -= 1  # the longest prefix whose blocks in the next window are all cached
        first = self._first_needed(hit * bs)
        return [NULL_BLOCK] * first + found[first:hit]

    def find_cached_prefix(self, seqs: list[Sequence], cache_salt: str | None = None) -> list[list[int]]:
        """Cached blocks for each of a request's new sequences, all of one length (the fewest any
        of them has), so that the request's sequences stay in step. Blocks only a tier had are
        loaded into free device blocks first."""
        if self.pool.offload is None:
            return self._find_cached_prefix(seqs, cache_salt, False)
        return self.pool.offload.materialize(self.pool, lambda tiers: self._find_cached_prefix(seqs, cache_salt, tiers))

    def _find_cached_prefix(self, seqs: list[Sequence], cache_salt: str | None, use_tiers: bool) -> list:
        limit = min((s.num_tokens - 1) // self.block_size for s in seqs)
        while True:
            found = [self.find_cached_blocks(s, cache_salt, limit, use_tiers) for s in seqs]
            shortest = min(map(len, found))
            if all(len(f) == shortest for f in found):
                return found
            limit = shortest

    def _cache_full_blocks(self, seq: Sequence, cache_salt: str | None, num_tokens: int) -> None:
        """Registers the blocks that hold ``num_tokens`` tokens once this step has run.

        Registering at schedule time is safe: a request that reuses such a block in the same step
        reads it only after the step's layer has written it (each layer writes the K/V of every
        token in the batch before any of them attends).
        """
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, self.block_table(seq)
        hashes = self.block_hashes.setdefault(seq.seq_id, [])
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else self._root_hash(cache_salt)
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block_hash = hash((parent, chunk))
            if table[i] != NULL_BLOCK:  # (a resumed sequence has none before its window)
                self.pool.register(table[i], block_hash, parent, chunk)
            hashes.append(block_hash)

    # Metrics ----------------------------------------------------------------------------------------
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def filled_slots(self, seqs: list[Sequence], filled: dict[int, int]) -> dict[int, int]:
        """Adds to ``filled`` (block -> slots holding tokens) the blocks of these sequences."""
        for seq in seqs:
            for i, block in enumerate(self.block_table(seq)):
                if block != NULL_BLOCK:
                    n = min(self.block_size, max(0, seq.num_computed_tokens - i * self.block_size))
                    filled[block] = max(filled.get(block, 0), n)
        return filled

    def utilization(self, seqs: list[Sequence]) -> float:
        """Token slots holding tokens / slots in allocated blocks (shared blocks counted once)."""
        filled = self.filled_slots(seqs, {})
        if not filled:
            return 0.0
        return sum(filled.values()) / (len(filled) * self.block_size)
