"""Continuous batching under a token budget, with preemption when the block pool runs out.

Prompt and generated tokens are scheduled alike: each step a request gets up to
``num_tokens - num_computed_tokens`` tokens, so long prompts are chunked across steps and mixed
with decode rows, and a preempted request simply recomputes what it lost.

With ``preemption_mode="swap"`` a preempted request's blocks are copied to host memory instead
(while the swap space, counted in blocks, has room; otherwise it falls back to recompute) and come
back into freshly allocated blocks when the request is resumed, its computed tokens kept.
"""
from collections import deque
from dataclasses import dataclass, field

from jpaged.config import SchedulerConfig
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # per live sequence of the request

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new token is sampled."""
        seq = self.request.live_seqs[0]
        return seq.num_computed_tokens + self.num_new_tokens == seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, list[int]]] = field(default_factory=list)  # (seq_id, device blocks)
    swap_in: list[tuple[int, list[int]]] = field(default_factory=list)   # (seq_id, new device blocks)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens * len(s.request.live_seqs) for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, *,
                 preemption_mode: str = "recompute", swap_capacity_blocks: int = 0):
        self.config = config
        self.kv_cache = kv_cache
        self.preemption_mode = preemption_mode
        self.swap_capacity_blocks = swap_capacity_blocks
        self.num_swapped_blocks = 0  # host blocks in use
        self.swapped: dict[str, dict[int, int]] = {}  # request id -> {seq_id: blocks on the host}
        self.num_swap_outs = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:  # running requests first, oldest first
            request = self.running[i]
            seqs = request.live_seqs
            n = min(seqs[0].num_tokens - seqs[0].num_computed_tokens, budget // len(seqs))
            if n <= 0:
                break
            while not self.kv_cache.can_allocate(seqs, n):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim, out)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:  # room found without preempting this request itself
                self._allocate(request, n)
                out.scheduled.append(ScheduledRequest(request, n))
                budget -= n * len(seqs)
                i += 1
                continue
            break
        num_seqs = sum(len(r.live_seqs) for r in self.running)
        # then waiting requests, in order, while nothing had to be preempted this step
        while self.waiting and budget > 0 and not out.preempted:
            request = self.waiting[0]
            seqs = request.live_seqs
            if num_seqs + len(seqs) > self.config.max_num_seqs:
                break
            fresh = all(s.num_computed_tokens == 0 and not self.kv_cache.block_table(s) for s in seqs)
            if fresh:
                cached = [self.kv_cache.match_prefix(s, request.cache_salt) for s in seqs]
                request.num_cached_tokens = max(request.num_cached_tokens, min(cached))
            n = min(seqs[0].num_tokens - seqs[0].num_computed_tokens, budget // len(seqs))
            if n <= 0 or not self.kv_cache.can_allocate(seqs, n):
                if fresh:
                    for s in seqs:
                        self.kv_cache.free(s)
                        s.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self._allocate(request, n)
            for seq_id, num_blocks in self.swapped.pop(request.request_id, {}).items():
                seq = next(s for s in seqs if s.seq_id == seq_id)
                out.swap_in.append((seq_id, self.kv_cache.block_table(seq)[:num_blocks]))
                self.num_swapped_blocks -= num_blocks
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n))
            budget -= n * len(seqs)
            num_seqs += len(seqs)
        out.block_copies = self.kv_cache.take_pending_copies()
        return out

    def _allocate(self, request: Request, num_new_tokens: int) -> None:
        for seq in request.live_seqs:
            self.kv_cache.allocate(seq, num_new_tokens)
            self.kv_cache.cache_full_blocks(seq, request.cache_salt, seq.num_computed_tokens + num_new_tokens)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """All of the request's blocks go back (to the host first, when swapping); it waits at the front."""
        seqs = request.live_seqs
        tables = [self.kv_cache.block_table(s) for s in seqs]
        num_blocks = sum(len(t) for t in tables)
        swap = (self.preemption_mode == "swap"
                and self.num_swapped_blocks + num_blocks <= self.swap_capacity_blocks)
        if swap:
            self.swapped[request.request_id] = {s.seq_id: len(t) for s, t in zip(seqs, tables)}
            out.swap_out += [(s.seq_id, list(t)) for s, t in zip(seqs, tables)]
            self.num_swapped_blocks += num_blocks
            self.num_swap_outs += 1
        for seq in request.seqs:
            self.kv_cache.free(seq)
            if not swap:
                seq.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Frees a finished or aborted request, wherever it is (its host copy too)."""
        self.num_swapped_blocks -= sum(self.swapped.pop(request.request_id, {}).values())
        for seq in request.seqs:
            self.kv_cache.free(seq)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
