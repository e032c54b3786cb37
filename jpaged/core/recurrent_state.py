"""State slots of a model with recurrent layers (host only, no JAX).

A recurrent layer (gated delta-net linear attention, `jpaged.models.gated_delta_net`) keeps no KV
per token but one fixed-size state per sequence, updated by every token. The device holds, per
recurrent layer, a pool of ``num_slots`` states (`jpaged.runner.kv_pool.KVPool`); this class hands
out the slot ids as the block pool hands out blocks, and the step carries each sequence's slot as
data (``ScheduledSeq.state_slot``), so nothing recompiles when slots change.

- A sequence takes a slot when it is first scheduled: `allocate_slots` takes its blocks and its
  slot all or nothing, so a short slot pool preempts like a short block pool.
- A fork (``n > 1`` samples, beams) shares its parent's slot (reference counts); the first step
  that writes a shared slot gives the writer a copy (the last writer keeps the original), as a
  shared, partly filled block is copied on write. The copies (source slot, new slot) are queued
  and sent to the device before the step (``SchedulerOutput.state_copies``).
- Finishing or preemption frees the slot. A preempted sequence is recomputed from position 0, and
  its state with it: a step that starts at position 0 starts from zeros, whatever the slot held.
  (Swapping a state to host memory is not done: these models preempt by recompute.)
- Prefix caching is off for these models: a block's KV is a function of its tokens, but a state
  holds everything before it, so a cached block alone cannot resume a sequence.

Every other request of the KV cache is the wrapped manager's (`KVCacheManager` or
`HybridKVCacheManager`: the blocks of the full-attention layers).
"""
from jpaged.core.request import Sequence

NO_SLOT = -1  # ScheduledSeq.state_slot of a sequence without one (a model without recurrent layers)


class RecurrentStateCache:
    """A KV cache manager and ``num_slots`` recurrent-state slots (the module docstring)."""

    def __init__(self, kv_cache, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: the state pool needs at least one slot")
        self.kv_cache = kv_cache
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self.ref_counts = [0] * num_slots
        self.slots: dict[int, int] = {}  # seq_id -> slot
        self.pending_copies: list[tuple[int, int]] = []  # (source slot, new slot)

    # The state slots ------------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def state_slot(self, seq: Sequence) -> int:
        return self.slots.get(seq.seq_id, NO_SLOT)

    def slots_needed(self, seqs: list[Sequence]) -> int:
        """New slots a step of these sequences takes: one per sequence without a slot, and one per
        writer of a shared slot except its last."""
        holders: dict[int, int] = {}  # slot -> holders not yet given a copy
        need = 0
        for seq in seqs:
            slot = self.slots.get(seq.seq_id)
            if slot is None:
                need += 1
                continue
            left = holders.get(slot, self.ref_counts[slot])
            if left > 1:
                holders[slot] = left - 1
                need += 1
        return need

    def _take_slots(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            slot = self.slots.get(seq.seq_id)
            if slot is not None and self.ref_counts[slot] == 1:
                continue
            new = self.free_slots.pop()
            self.ref_counts[new] = 1
            self.slots[seq.seq_id] = new
            if slot is not None:  # copy-on-write: the state so far, into the writer's own slot
                self.ref_counts[slot] -= 1
                self.pending_copies.append((slot, new))

    def _release(self, seq: Sequence) -> None:
        slot = self.slots.pop(seq.seq_id, None)
        if slot is None:
            return
        self.ref_counts[slot] -= 1
        if not self.ref_counts[slot]:
            self.free_slots.append(slot)

    def take_pending_state_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # The KV cache protocol (`jpaged.core.kv_cache_manager.KVCache`), the slots besides ------------------
    def allocate_slots(self, seqs: list[Sequence], num_new_tokens: int, cached_blocks: list | None = None,
                       cache_salt: str | None = None) -> list[list[int]] | None:
        """The blocks of `KVCacheManager.allocate_slots` and a slot of its own for each sequence,
        all or nothing (None, nothing changed, when either pool is short)."""
        if self.slots_needed(seqs) > self.num_free_slots:
            return None
        new_blocks = self.kv_cache.allocate_slots(seqs, num_new_tokens, cached_blocks, cache_salt)
        if new_blocks is not None:
            self._take_slots(seqs)
        return new_blocks

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's blocks and its state slot."""
        self.kv_cache.fork(parent, child)
        slot = self.slots.get(parent.seq_id)
        if slot is not None:
            self.ref_counts[slot] += 1
            self.slots[child.seq_id] = slot

    def free(self, seq: Sequence) -> None:
        self.kv_cache.free(seq)
        self._release(seq)

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def pool(self):
        return self.kv_cache.pool

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache.prefix_cache_hits

    def block_table(self, seq: Sequence) -> list[int]:
        return self.kv_cache.block_table(seq)

    def group_block_tables(self, seq: Sequence) -> list[list[int]]:
        return self.kv_cache.group_block_tables(seq)

    def find_cached_prefix(self, seqs: list[Sequence], cache_salt: str | None = None) -> list:
        return self.kv_cache.find_cached_prefix(seqs, cache_salt)

    def set_weights_version(self, version: int) -> None:
        self.kv_cache.set_weights_version(version)

    def reserve_slots(self, seqs: list[Sequence], num_new_tokens: int) -> bool:
        """Blocks for a decode window (each sequence already holds a slot of its own: the window's
        step allocated it)."""
        return self.kv_cache.reserve_slots(seqs, num_new_tokens)

    def free_blocks_past(self, seq: Sequence, num_tokens: int) -> None:
        self.kv_cache.free_blocks_past(seq, num_tokens)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return self.kv_cache.take_pending_copies()

    def usage(self) -> float:
        return self.kv_cache.usage()

    def utilization(self, seqs: list[Sequence]) -> float:
        return self.kv_cache.utilization(seqs)
