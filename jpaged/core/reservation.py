"""Contiguous-reservation KV cache managers: the Orca baselines of the vLLM paper (benchmarks only).

Before PagedAttention, a server reserved for each request, at admission, one contiguous run of
KV slots sized for the longest output it might produce, and held it until the request finished.
The vLLM paper compares against three versions of Orca that differ only in that size:

  ``max``     the model's maximum length (``max_model_len`` slots, prompt included);
  ``pow2``    the prompt plus the true output length rounded up to a power of two;
  ``oracle``  the prompt plus exactly the true output length.

The true output length is ``Sequence.max_tokens`` (set by the engine), which is exact for requests
with ``ignore_eos=True``. Reservations are rounded up to whole blocks and capped at
``max_model_len`` (and at the pool size, so that ``max`` with a pool smaller than one max-length
request still runs one request at a time instead of never).

``ReservationKVCacheManager`` is a drop-in for ``KVCacheManager``: the same scheduler, model runner
and kernels run on top of it, so the only difference from the paged engine is memory management.
Runs are placed first-fit over block ids by ``ContiguousPool``, a real free-extent allocator, so
external fragmentation happens the way it does in a contiguous allocator: free blocks that lie in
holes too small for the next request's reservation stay empty (``external_fragmentation``).

A sequence's block table is its run's first ``ceil(slots used / block_size)`` block ids, which are
consecutive: the attention kernel reads exactly what a contiguous kernel would, and no more.
"""
import bisect

from jpaged.core.block_pool import NoFreeBlocksError
from jpaged.core.request import Sequence
from jpaged.utils import cdiv, next_power_of_two

MODES = ("max", "pow2", "oracle")


class ContiguousPool:
    """Block ids ``0..num_blocks-1`` handed out as contiguous runs: first fit, coalescing free.

    ``free_runs`` is the sorted list of maximal free extents ``[start, length]``. Offers the
    ``BlockPool`` attributes the engine reads (``num_blocks``, ``num_free_blocks``,
    ``num_used_blocks``, ``ref_counts``, ``check_invariants``).
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_runs: list[list[int]] = [[0, num_blocks]] if num_blocks else []
        self.num_free_blocks = num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def largest_free_run(self) -> int:
        return max((n for _, n in self.free_runs), default=0)

    def fits(self, lengths: list[int]) -> bool:
        """Whether first fit can place all these runs, in order, without changing anything."""
        runs = [list(r) for r in self.free_runs]
        for length in lengths:
            run = next((r for r in runs if r[1] >= length), None)
            if run is None:
                return False
            run[0] += length
            run[1] -= length
        return True

    def allocate(self, length: int) -> int:
        """First id of a run of ``length`` free blocks: the lowest hole that fits (first fit)."""
        for i, (start, n) in enumerate(self.free_runs):
            if n >= length:
                if n == length:
                    del self.free_runs[i]
                else:
                    self.free_runs[i] = [start + length, n - length]
                for b in range(start, start + length):
                    self.ref_counts[b] = 1
                self.num_free_blocks -= length
                return start
        raise NoFreeBlocksError(f"no run of {length} contiguous free blocks (largest hole: "
                                f"{self.largest_free_run}, free in all: {self.num_free_blocks})")

    def free(self, start: int, length: int) -> None:
        """Returns a run, merging it with the holes on either side."""
        for b in range(start, start + length):
            if self.ref_counts[b] != 1:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] = 0
        self.num_free_blocks += length
        i = bisect.bisect_left(self.free_runs, [start, 0])
        if i > 0 and sum(self.free_runs[i - 1]) == start:  # merge with the hole before
            i -= 1
            self.free_runs[i][1] += length
        else:
            self.free_runs.insert(i, [start, length])
        if i + 1 < len(self.free_runs) and sum(self.free_runs[i]) == self.free_runs[i + 1][0]:
            self.free_runs[i][1] += self.free_runs.pop(i + 1)[1]  # ... and with the one after

    def check_invariants(self) -> None:
        """For tests: extents sorted, disjoint, coalesced; exactly their blocks have ref count 0."""
        free = [False] * self.num_blocks
        end = -1
        for start, n in self.free_runs:
            assert n > 0 and start > end, f"free runs not sorted, disjoint and coalesced: {self.free_runs}"
            end = start + n
            for b in range(start, end):
                free[b] = True
        assert sum(free) == self.num_free_blocks
        for b, rc in enumerate(self.ref_counts):
            assert rc in (0, 1) and (rc == 0) == free[b], f"block {b}: ref {rc}, free {free[b]}"


class ReservationKVCacheManager:
    """Reserves one contiguous run per sequence at its first allocation; see the module docstring."""

    def __init__(self, num_blocks: int, block_size: int, mode: str = "oracle", max_model_len: int | None = None):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {MODES}")
        if not (isinstance(max_model_len, int) and max_model_len >= 1):
            raise ValueError(f"max_model_len={max_model_len!r}: a reservation allocator needs the model's "
                             f"maximum length")
        self.block_size = block_size
        self.mode = mode
        self.max_model_len = max_model_len
        self.pool = ContiguousPool(num_blocks)
        self.enable_prefix_caching = False
        self.reservations: dict[int, tuple[int, int]] = {}  # seq_id -> (first block, num blocks)
        self.num_slots_touched: dict[int, int] = {}         # seq_id -> slots allocated to it so far
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # Sizing ------------------------------------------------------------------------------------------
    def reservation_tokens(self, seq: Sequence) -> int:
        """Slots reserved at admission: the prompt plus the mode's output reservation, capped."""
        prompt, limit = seq.num_prompt_tokens, self.max_model_len
        output = seq.max_tokens if seq.max_tokens is not None else limit - prompt
        if self.mode == "max":
            total = limit
        elif self.mode == "pow2":
            total = prompt + next_power_of_two(output)
        else:
            total = prompt + output
        return max(min(total, limit), seq.num_tokens)

    def reservation_blocks(self, seq: Sequence) -> int:
        """Blocks a not-yet-admitted sequence would reserve (at most the whole pool)."""
        return min(cdiv(self.reservation_tokens(seq), self.block_size), self.pool.num_blocks)

    # The KVCacheManager interface ------------------------------------------------------------------------
    def block_table(self, seq: Sequence) -> list[int]:
        """The run's first blocks, as many as cover the slots allocated so far (consecutive ids)."""
        res = self.reservations.get(seq.seq_id)
        if res is None:
            return []
        return list(range(res[0], res[0] + cdiv(self.num_slots_touched[seq.seq_id], self.block_size)))

    def reserved_blocks(self, seq: Sequence) -> list[int]:
        """The whole reserved run (for memory accounting)."""
        res = self.reservations.get(seq.seq_id)
        return [] if res is None else list(range(res[0], res[0] + res[1]))

    def allocate_slots(self, seqs: list[Sequence], num_new_tokens: int,
                       cached_blocks: list[list[int]] | None = None,
                       cache_salt: str | None = None) -> list[list[int]] | None:
        """Reserves each new sequence's run (first fit), all or nothing; None when one does not fit.

        A sequence already admitted takes nothing more: its reservation covers its whole output
        (this raises if it does not, which only a wrong ``max_tokens`` causes).
        """
        new = [s for s in seqs if s.seq_id not in self.reservations]
        if not self.pool.fits([self.reservation_blocks(s) for s in new]):
            return None
        new_blocks = []
        for seq in seqs:
            if seq.seq_id not in self.reservations:
                length = self.reservation_blocks(seq)
                start = self.pool.allocate(length)
                self.reservations[seq.seq_id] = (start, length)
                self.num_slots_touched[seq.seq_id] = 0
                new_blocks.append(list(range(start, start + length)))
            else:
                new_blocks.append([])
            need = seq.num_computed_tokens + num_new_tokens
            if cdiv(need, self.block_size) > self.reservations[seq.seq_id][1]:
                raise RuntimeError(f"sequence {seq.seq_id} needs {need} slots but reserved "
                                   f"{self.reservations[seq.seq_id][1] * self.block_size} ({self.mode}); "
                                   f"its max_tokens ({seq.max_tokens}) was not its true output length")
            self.num_slots_touched[seq.seq_id] = max(self.num_slots_touched[seq.seq_id], need)
        return new_blocks

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child gets its own run of the parent's size and a copy of its blocks (no sharing).

        Raises ``NoFreeBlocksError`` when no hole fits: the scheduler admitted only the parent's run.
        """
        first, length = self.reservations[parent.seq_id]
        start = self.pool.allocate(length)
        self.reservations[child.seq_id] = (start, length)
        touched = self.num_slots_touched[parent.seq_id]
        self.num_slots_touched[child.seq_id] = touched
        self.pending_copies += [(first + i, start + i) for i in range(cdiv(touched, self.block_size))]

    def free(self, seq: Sequence) -> None:
        res = self.reservations.pop(seq.seq_id, None)
        self.num_slots_touched.pop(seq.seq_id, None)
        if res is not None:
            self.pool.free(*res)

    def reserve_slots(self, seqs: list[Sequence], num_new_tokens: int) -> bool:
        """Declines decode windows: a window may run past a shorter request's reservation."""
        return False

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def find_cached_blocks(self, seq: Sequence, cache_salt: str | None = None) -> list[int]:
        return []  # no prefix caching: contiguous per-request buffers cannot share

    def set_weights_version(self, version: int) -> None:
        """Nothing cached, nothing to invalidate."""

    def find_cached_prefix(self, seqs: list[Sequence], cache_salt: str | None = None) -> list[list[int]]:
        return [[] for _ in seqs]

    def group_block_tables(self, seq: Sequence) -> list[list[int]]:
        return []  # one KV-cache group: models with sliding-window layers run on the paged allocator

    # Metrics --------------------------------------------------------------------------------------------
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def utilization(self, seqs: list[Sequence]) -> float:
        """Token slots holding tokens / slots in the reserved runs of these sequences."""
        reserved = sum(self.reservations[s.seq_id][1] for s in seqs if s.seq_id in self.reservations)
        if not reserved:
            return 0.0
        used = sum(s.num_computed_tokens for s in seqs if s.seq_id in self.reservations)
        return used / (reserved * self.block_size)

    def external_fragmentation(self, next_seq: Sequence | None) -> int:
        """Free blocks in holes too small for ``next_seq``'s reservation (0 when none waits).

        These are the paper's external fragmentation: free, yet stranded between reservations,
        so the next request waits although they are there. (A paged pool has none: any free
        block fits any request.)
        """
        if next_seq is None:
            return 0
        need = self.reservation_blocks(next_seq)
        return sum(n for _, n in self.pool.free_runs if n < need)
