"""Block tables per sequence: allocate as tokens arrive, share by fork, copy on write, free.

Nothing here touches the device. Copies that copy-on-write decides on are queued in
``pending_copies`` and sent to the device in one batched ``copy_blocks`` call by the model runner.
"""
from jpaged.core.block_pool import BlockPool
from jpaged.request import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 share_forked_blocks: bool = True):
        self.block_size = block_size
        self.share_forked_blocks = share_forked_blocks  # False: forks copy every block (to measure sharing)
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[int, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src block, dst block)
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0     # tokens found

    def block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables.get(seq.seq_id, [])

    # Allocation ---------------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks for the next ``num_new_tokens`` tokens, a copy-on-write copy included."""
        table = self.block_table(seq)
        need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if self._shared_block_written(seq, table, num_new_tokens) is not None:
            need += 1
        return max(need, 0)

    def can_allocate(self, seqs: list[Sequence], num_new_tokens: int) -> bool:
        need = sum(self.num_blocks_needed(s, num_new_tokens) for s in seqs)
        return need <= self.pool.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Makes the table cover the next ``num_new_tokens`` slots (call ``can_allocate`` first)."""
        table = self.block_tables.setdefault(seq.seq_id, [])
        shared = self._shared_block_written(seq, table, num_new_tokens)
        if shared is not None:  # copy-on-write: the last writer keeps the original
            src = table[shared]
            dst = self.pool.allocate()
            self.pending_copies.append((src, dst))
            self.pool.decref(src)
            table[shared] = dst
        while len(table) < cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size):
            table.append(self.pool.allocate())

    def _shared_block_written(self, seq, table, num_new_tokens) -> int | None:
        """Index of a partly filled block that is shared and about to be written, if any."""
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

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # Prefix caching -------------------------------------------------------------------------------
    def _root_hash(self, cache_salt: str | None) -> int | None:
        return None if cache_salt is None else hash(("salt", cache_salt))

    def match_prefix(self, seq: Sequence, cache_salt: str | None = None) -> int:
        """Reuses the longest run of cached full blocks for a sequence with nothing computed.

        The last token is always recomputed (its logits are needed), so at most
        ``(num_tokens - 1) // block_size`` blocks are reused. Returns the cached token count.
        """
        assert seq.num_computed_tokens == 0 and seq.seq_id not in self.block_tables
        if not self.enable_prefix_caching:
            return 0
        bs, tokens = self.block_size, seq.token_ids
        self.prefix_cache_queries += len(tokens)
        parent = self._root_hash(cache_salt)
        blocks, hashes = [], []
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            block_hash = hash((parent, chunk))
            block = self.pool.lookup(block_hash, parent, chunk)
            if block is None:
                break
            blocks.append(block)
            hashes.append(block_hash)
            parent = block_hash
        for block in blocks:
            self.pool.incref(block)
        self.block_tables[seq.seq_id] = blocks
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(blocks) * bs
        self.prefix_cache_hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence, cache_salt: str | None = None, num_tokens: int | None = None) -> None:
        """Registers the sequence's newly full blocks in the prefix cache.

        ``num_tokens`` (default: the computed ones) is how many tokens will be in the cache once the
        step being scheduled has run. Registering at schedule time is safe: a request that reuses
        such a block in the same step reads it only after the step's layer has written it (each
        layer writes the K/V of every token in the batch before any of them attends).
        """
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, self.block_table(seq)
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
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
