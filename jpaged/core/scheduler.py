"""Continuous batching under a token budget, with preemption when the block pool runs out.

The scheduler owns every change to request state. Each step:

1. ``schedule()`` gives each running request up to ``num_tokens - num_computed_tokens`` tokens
   (prompt and generated tokens alike, so long prompts are chunked and mixed with decode rows),
   then admits waiting requests, and returns a `SchedulerOutput`: a snapshot of plain data that is
   all the model runner reads (tokens, positions, block tables, block copies, swaps).
2. ``update_from_output()`` applies the sampled tokens: computed counts advance, tokens are
   appended, token-level stop conditions checked, the prompt of an ``n > 1`` request forks into
   its samples, beams fork or end, and finished sequences return their blocks.

When the pool runs out the newest running request is preempted (all of its blocks): by recompute,
or with ``preemption_mode="swap"`` by copying its blocks to host memory (while the swap space,
counted in blocks, has room) to bring them back into fresh blocks when it resumes.
"""
from collections import deque
from dataclasses import dataclass, field

from jpaged import beam_search, prompt_logprobs
from jpaged.config import SchedulerConfig
from jpaged.core.kv_cache_manager import KVCache
from jpaged.request import Request, Sequence


@dataclass
class ScheduledSeq:
    """One sequence's part of a step: compute ``token_ids`` at positions ``start, start + 1, ...``."""

    token_ids: list[int]
    start: int
    block_table: list[int]  # a copy: covers every slot this step writes


@dataclass
class SampleRow:
    """A row of logits to sample from: the last token of ``seqs[seq_row]``.

    The first sampling step of a request with ``n > 1`` has n rows on its one prompt sequence
    (``sample_index`` 0..n-1); the request forks into its samples once they are drawn.
    """

    request: Request
    seq: Sequence
    sample_index: int
    seq_row: int


@dataclass
class PromptLogprobRow:
    """Position ``position`` of ``seqs[seq_row]`` predicts prompt token ``target`` (prompt_logprobs)."""

    request: Request
    seq_row: int
    position: int
    target: int


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int      # per sequence in ``seqs``
    seqs: list[Sequence]     # the request's live sequences when scheduled


@dataclass
class SchedulerOutput:
    """Everything one step does. The runner reads ``seqs``, ``sample_rows``, copies and swaps."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    seqs: list[ScheduledSeq] = field(default_factory=list)
    sample_rows: list[SampleRow] = field(default_factory=list)
    prompt_logprob_rows: list[PromptLogprobRow] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, list[int]]] = field(default_factory=list)  # (seq_id, device blocks)
    swap_in: list[tuple[int, list[int]]] = field(default_factory=list)   # (seq_id, new device blocks)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCache, *, max_model_len: int,
                 preemption_mode: str = "recompute", swap_capacity_blocks: int = 0):
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
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

    # Phase 1: schedule ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:  # running requests first, oldest first
            request = self.running[i]
            n = self._num_new_tokens(request, budget)
            if n <= 0:
                break
            while self.kv_cache.allocate_slots(request.live_seqs, n, cache_salt=request.cache_salt) is None:
                victim = self.running.pop()  # the newest running request
                self._preempt(victim, out)
                if victim is request:
                    break
            else:  # room found without preempting this request itself
                budget -= self._add(out, request, n)
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
            cached = self._cached_prefix(request)
            n = self._num_new_tokens(request, budget, len(cached[0]) * self.kv_cache.block_size if cached else 0)
            if n <= 0 or self.kv_cache.allocate_slots(seqs, n, cached, request.cache_salt) is None:
                break
            self.waiting.popleft()
            if cached is not None:
                request.num_cached_tokens = max(request.num_cached_tokens, seqs[0].num_computed_tokens)
            for seq_id, num_blocks in self.swapped.pop(request.request_id, {}).items():
                seq = next(s for s in seqs if s.seq_id == seq_id)
                out.swap_in.append((seq_id, self.kv_cache.block_table(seq)[:num_blocks]))
                self.num_swapped_blocks -= num_blocks
            self.running.append(request)
            budget -= self._add(out, request, n)
            num_seqs += len(seqs)
        out.block_copies = self.kv_cache.take_pending_copies()
        return out

    def plan_decode_window(self, out: SchedulerOutput, max_steps: int) -> int:
        """How many decode steps ``out`` runs on the device before the host sees a token (1: this
        step alone).

        A window needs a step in which every sequence decodes one token into one sample row, with
        no copies or swaps, and sampling that needs no host between tokens (no grammar, penalties
        or bad words; ``min_tokens`` bans are lifted on the device). It lasts until the longest
        ``max_tokens`` is reached (rows that end sooner compute unused tokens), at most
        ``max_steps`` steps and never past ``max_model_len``; its slots are reserved here (the KV
        cache may decline), and the step's block tables updated. Stops and finishes are then
        applied token by token (`window_substep`). A request that waits (for blocks or a sequence
        slot: one that fits would have been admitted into this step, which would then not be
        decode-only) is admitted after the window, up to ``max_steps - 1`` steps later than without
        one.
        """
        if (max_steps <= 1 or out.block_copies or out.swap_in or out.swap_out
                or out.preempted or out.prompt_logprob_rows or len(out.sample_rows) != len(out.seqs)
                or any(len(s.token_ids) != 1 for s in out.seqs)
                or any(row.seq_row != i for i, row in enumerate(out.sample_rows))):
            return 1
        steps, longest = max_steps, 0
        for sr in out.requests:
            p = sr.request.sampling_params
            if (sr.request.beam is not None or p._grammar is not None or p.uses_penalties
                    or p._bad_word_ids):
                return 1
            for seq in sr.seqs:
                steps = min(steps, self.max_model_len - seq.num_tokens)
                longest = max(longest, max_steps if p.max_tokens is None else p.max_tokens - seq.num_output_tokens)
        steps = min(steps, longest)
        seqs = [seq for sr in out.requests for seq in sr.seqs]
        if steps <= 1 or not self.kv_cache.reserve_slots(seqs, steps):
            return 1
        for scheduled, seq in zip(out.seqs, seqs):
            scheduled.block_table = list(self.kv_cache.block_table(seq))
        return steps

    @staticmethod
    def window_substep(out: SchedulerOutput) -> tuple[SchedulerOutput, list[int]]:
        """The part of a decode window's step that is still live (requests and rows not finished),
        and the indices of its sample rows in ``out``'s."""
        rows = [i for i, row in enumerate(out.sample_rows) if not row.seq.finished]
        live = {id(out.sample_rows[i].request) for i in rows}
        requests = [sr for sr in out.requests if id(sr.request) in live]
        return SchedulerOutput(requests=requests, sample_rows=[out.sample_rows[i] for i in rows]), rows

    def _num_new_tokens(self, request: Request, budget: int, num_cached_tokens: int = 0) -> int:
        seqs = request.live_seqs
        todo = seqs[0].num_tokens - seqs[0].num_computed_tokens - num_cached_tokens
        return min(todo, budget // len(seqs))

    def _cached_prefix(self, request: Request) -> list[list[int]] | None:
        """Cached blocks for a request with nothing computed (None for one resumed from swap).

        Every sequence starts from the same number of cached blocks (the fewest found), so the
        request's sequences stay in step: each step gives all of them the same token count.
        """
        seqs = request.live_seqs
        if any(s.num_computed_tokens for s in seqs):
            return None
        found = [self.kv_cache.find_cached_blocks(s, request.cache_salt) for s in seqs]
        k = min(map(len, found))
        return [blocks[:k] for blocks in found]

    def _add(self, out: SchedulerOutput, request: Request, n: int) -> int:
        """Puts the request's sequences into the step's snapshot; returns the tokens it uses."""
        seqs = list(request.live_seqs)
        out.requests.append(ScheduledRequest(request, n, seqs))
        samples = seqs[0].num_computed_tokens + n == seqs[0].num_tokens
        first_of_many = request.beam is None and len(request.seqs) == 1 and request.sampling_params.n > 1
        for seq in seqs:
            start = seq.num_computed_tokens
            out.seqs.append(ScheduledSeq(seq.token_ids[start:start + n], start,
                                         list(self.kv_cache.block_table(seq))))
            out.prompt_logprob_rows += [PromptLogprobRow(request, len(out.seqs) - 1, p, seq.token_ids[p + 1])
                                        for p in prompt_logprobs.wanted(request, seq, start, n)]
            if samples:
                indices = range(request.sampling_params.n) if first_of_many else [seq.index]
                out.sample_rows += [SampleRow(request, seq, k, len(out.seqs) - 1) for k in indices]
        return n * len(seqs)

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
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def preempt_all(self) -> None:
        """Every running request goes back to waiting to recompute (after the KV pool was lost)."""
        while self.running:
            request = self.running.pop()
            for seq in request.seqs:
                self.kv_cache.free(seq)
                seq.num_computed_tokens = 0
            self.waiting.appendleft(request)

    # Phase 2: apply the step's results -----------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, tokens, logprobs, top_ids, top_logprobs,
                           prompt_results=None) -> list[tuple[Request, list[Sequence]]]:
        """Applies one step's sampled tokens (one per sample row); returns each scheduled request
        with the sequences that received a token (finished requests are already freed)."""
        if out.prompt_logprob_rows:
            rows = out.prompt_logprob_rows
            prompt_logprobs.record([(r.request, r.position) for r in rows], [r.target for r in rows],
                                   prompt_results)
        for sr in out.requests:
            for seq in sr.seqs:
                seq.num_computed_tokens += sr.num_new_tokens
        rows_by_request: dict[int, list[int]] = {}
        for i, row in enumerate(out.sample_rows):
            rows_by_request.setdefault(id(row.request), []).append(i)
        advanced = []
        for sr in out.requests:
            request, new = sr.request, []
            rows = rows_by_request.get(id(request), [])
            if request.beam is not None and rows:
                new = self._beam_step(request, [out.sample_rows[i] for i in rows],
                                      [(top_ids[i], top_logprobs[i]) for i in rows])
            elif rows:
                new = self._append_samples(request, [out.sample_rows[i] for i in rows],
                                           [(int(tokens[i]), float(logprobs[i]), top_ids[i], top_logprobs[i])
                                            for i in rows])
            self._free_finished(request)
            advanced.append((request, new))
        return advanced

    def _append_samples(self, request: Request, rows: list[SampleRow], samples: list) -> list[Sequence]:
        """Appends a request's sampled tokens; forks the prompt sequence on its first n > 1 sample."""
        seqs = [row.seq for row in rows]
        if len(rows) > 1 and len(request.seqs) == 1:
            parent = request.seqs[0]
            for k, row in enumerate(rows[1:], start=1):
                child = parent.fork(row.sample_index)
                self.kv_cache.fork(parent, child)
                request.seqs.append(child)
                seqs[k] = child
        for seq, (token, logprob, top_ids, top_lps) in zip(seqs, samples):
            seq.append_token(token, logprob, top_ids, top_lps, request.sampling_params.logprobs)
            self._check_stop(request, seq, token)
        return seqs

    def _check_stop(self, request: Request, seq: Sequence, token: int) -> None:
        params = request.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if not params.ignore_eos and token in request.eos_token_ids:
                seq.finish_reason = "stop"
                return
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) \
                or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _beam_step(self, request: Request, rows: list[SampleRow], tops: list) -> list[Sequence]:
        """Picks the next beams; a beam chosen twice forks (shares blocks), one not chosen is freed."""
        state = request.beam
        width = 2 * state.params.beam_width
        candidates = [beam_search.Candidate(row.seq.cumulative_logprob + float(lp), row.seq, int(t))
                      for row, (top_ids, top_lps) in zip(rows, tops)
                      for t, lp in zip(top_ids[:width], top_lps[:width])]
        chosen = beam_search.select(state, candidates, rows[0].seq.num_output_tokens, request.eos_token_ids)
        beams, kept = [], set()
        for c in chosen:  # fork first, from parents that have not taken their new token yet
            if id(c.parent) in kept:
                seq = c.parent.fork(len(beams))
                self.kv_cache.fork(c.parent, seq)
            else:
                kept.add(id(c.parent))
                seq = c.parent
            beams.append((seq, c))
        for seq in request.seqs:
            if id(seq) not in kept:
                self.kv_cache.free(seq)
        for i, (seq, c) in enumerate(beams):
            seq.token_ids.append(c.token)
            seq.cumulative_logprob, seq.index = c.score, i
        request.seqs = [seq for seq, _ in beams]
        return request.seqs

    def _free_finished(self, request: Request) -> None:
        if request.finished:
            self.finish(request)
        else:
            for seq in request.seqs:  # a finished sample returns its blocks at once
                if seq.finished:
                    self.kv_cache.free(seq)

    def stop_sequence(self, request: Request, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Ends one sequence (a stop string, an error); frees it, and the request once all ended."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._free_finished(request)

    def finish(self, request: Request) -> None:
        """Frees a finished or aborted request, wherever it is (its host copy too)."""
        self.num_swapped_blocks -= sum(self.swapped.pop(request.request_id, {}).values())
        for seq in request.seqs:
            self.kv_cache.free(seq)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
