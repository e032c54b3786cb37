"""Continuous batching under a token budget, with preemption when the block pool runs out.

The scheduler owns every change to request state. Each step:

1. ``schedule()`` gives each running request up to ``num_tokens - num_computed_tokens`` tokens
   (prompt and generated tokens alike, so long prompts are chunked and mixed with decode rows),
   then admits waiting requests, and returns a `SchedulerOutput`: plain data that is all the model
   runner reads (tokens, positions, block tables, copies, swaps, per-row sampling values). When
   every sequence decodes and ``num_scheduler_steps`` > 1, the step becomes a decode window.
2. ``update_from_output()`` applies the sampled tokens: computed counts advance, tokens are
   appended, token-level stop conditions checked, the prompt of an ``n > 1`` request forks into
   its samples, beams fork or end, and finished sequences return their blocks.

When the pool runs out the newest running request is preempted (all of its blocks): by recompute,
or with ``preemption_mode="swap"`` by copying its blocks to host memory (`SwapSpace`, while it has
room) to bring them back into fresh blocks when it resumes.
"""
from collections import deque

from jpaged.config import SchedulerConfig
from jpaged.core.kv_cache_manager import KVCache
from jpaged.core.recurrent_state import NO_SLOT, RecurrentStateCache
from jpaged.core.request import Request, Sequence
from jpaged.core.scheduler_output import (PromptLogprobRow, SampleRow, ScheduledRequest, ScheduledSeq,
                                          SchedulerOutput)
from jpaged.core.swap_space import SwapSpace
from jpaged.sample import beam_search, prompt_logprobs
from jpaged.sample.sampling_batch import build_sampling_batch
from jpaged.core.speculation import Speculation


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCache, *, max_model_len: int,
                 preemption_mode: str = "recompute", swap_capacity_blocks: int = 0, seed: int = 0,
                 speculative_config=None, lora_slots=None):
        """``lora_slots``: a `jpaged.lora.LoRASlotTable` when the engine serves LoRA adapters."""
        self.config = config
        self.lora_slots = lora_slots
        self.speculation = None if speculative_config is None else Speculation(speculative_config, kv_cache,
                                                                               max_model_len)
        self.kv_cache = kv_cache
        # a model with recurrent layers: each scheduled sequence carries its state slot
        self.recurrent_state = kv_cache if isinstance(kv_cache, RecurrentStateCache) else None
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.swap_space = SwapSpace(swap_capacity_blocks)
        self.seed = seed  # the engine seed: random streams of requests without their own
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_swap_outs = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r}: already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # Phase 1: schedule ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: list[Request] = []
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
                budget -= self._add(out, scheduled, request, n)
                i += 1
                continue
            break
        num_seqs = sum(len(r.live_seqs) for r in self.running)
        # then waiting requests, in order, while nothing had to be preempted this step (so no step
        # both swaps out and swaps in: host blocks freed by a swap-in are only reused later)
        while self.waiting and budget > 0 and not out.preempted:
            request = self.waiting[0]
            seqs = request.live_seqs
            if num_seqs + len(seqs) > self.config.max_num_seqs:
                break
            cached = self._cached_prefix(request)
            n = self._num_new_tokens(request, budget, len(cached[0]) * self.kv_cache.block_size if cached else 0)
            if n <= 0 or not self._pin_lora(request):  # no free adapter slot: it waits
                break
            if self.kv_cache.allocate_slots(seqs, n, cached, request.cache_salt) is None:
                self._unpin_lora(request)
                break
            self.waiting.popleft()
            if cached is not None:
                request.num_cached_tokens = max(request.num_cached_tokens, seqs[0].num_computed_tokens)
            if self.swap_space.is_swapped(request.request_id):
                out.swap_in += self.swap_space.swap_in(request.request_id, self._swap_tables(seqs))
            self.running.append(request)
            budget -= self._add(out, scheduled, request, n)
            num_seqs += len(seqs)
        if self.speculation is not None:  # with what is left of the budget and the free blocks
            self.speculation.add_proposals(out, {r.request_id: r for r in scheduled}, budget)
        out.block_copies = self.kv_cache.take_pending_copies()
        if self.recurrent_state is not None:
            out.state_copies = self.recurrent_state.take_pending_state_copies()
        if self.lora_slots is not None:
            out.lora_loads = self.lora_slots.take_loads()
        rows = [(self.requests[out.seqs[r.seq_row].request_id], self._row_seq(out, r), r.sample_index)
                for r in out.sample_rows]
        out.sampling = build_sampling_batch(rows, self.seed)
        out.num_steps = self._plan_decode_window(out, scheduled)
        offload = getattr(self.kv_cache.pool, "offload", None)
        if offload is not None:  # last: everything above may have evicted blocks
            out.kv_stores, out.kv_loads = offload.take_moves()
        return out

    def _seq(self, out: SchedulerOutput, seq_row: int) -> Sequence:
        scheduled = out.seqs[seq_row]
        return next(s for s in self.requests[scheduled.request_id].seqs if s.seq_id == scheduled.seq_id)

    def _row_seq(self, out: SchedulerOutput, row: SampleRow):
        """The sequence a sample row samples after: with a verification row's proposals."""
        seq = self._seq(out, row.seq_row)
        return seq if not row.spec_index else Speculation.row_sequence(seq, out.seqs[row.seq_row], row.spec_index)

    def _plan_decode_window(self, out: SchedulerOutput, scheduled: list[Request]) -> int:
        """How many decode steps ``out`` runs on the device before the host sees a token (1: this
        step alone).

        A window needs a step in which every sequence decodes one token into one sample row, with
        no copies or swaps, and sampling that needs no host between tokens (no grammar, penalties
        or bad words; ``min_tokens`` bans are lifted on the device). It lasts until the longest
        ``max_tokens`` is reached (rows that end sooner compute unused tokens), at most
        ``num_scheduler_steps`` steps and never past ``max_model_len``; its slots are reserved here
        (the KV cache may decline), and the step's block tables updated. The engine applies its
        tokens step by step (`update_from_output` with ``step_index``). A request that waits (for
        blocks or a sequence slot: one that fits would have been admitted into this step, which
        would then not be decode-only) is admitted after the window.
        """
        max_steps = self.config.num_scheduler_steps or 1  # unset: resolved by the engine's start-up
        if (max_steps <= 1 or out.block_copies or out.swap_in or out.swap_out
                or out.preempted or out.prompt_logprob_rows or len(out.sample_rows) != len(out.seqs)
                or any(len(s.token_ids) != 1 for s in out.seqs)
                or any(row.seq_row != i for i, row in enumerate(out.sample_rows))):
            return 1
        steps, longest = max_steps, 0
        for request in scheduled:
            p = request.sampling_params
            if request.beam is not None or request.grammar is not None or p.uses_penalties or request.bad_word_ids:
                return 1
            for seq in request.live_seqs:
                steps = min(steps, self.max_model_len - seq.num_tokens)
                longest = max(longest, max_steps if p.max_tokens is None else p.max_tokens - seq.num_output_tokens)
        steps = min(steps, longest)
        seqs = [self._seq(out, i) for i in range(len(out.seqs))]
        if steps <= 1 or not self.kv_cache.reserve_slots(seqs, steps):
            return 1
        for scheduled_seq, seq in zip(out.seqs, seqs):
            scheduled_seq.block_table, scheduled_seq.group_block_tables = self._tables(seq)
        return steps

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
        return self.kv_cache.find_cached_prefix(seqs, request.cache_salt)

    def _add(self, out: SchedulerOutput, scheduled: list[Request], request: Request, n: int) -> int:
        """Puts the request's sequences into the step's output; returns the tokens it uses."""
        seqs = list(request.live_seqs)
        scheduled.append(request)
        out.requests.append(ScheduledRequest(request.request_id, n))
        samples = seqs[0].num_computed_tokens + n == seqs[0].num_tokens
        first_of_many = request.beam is None and len(request.seqs) == 1 and request.sampling_params.n > 1
        k = request.sampling_params.prompt_logprobs
        for seq in seqs:
            start = seq.num_computed_tokens
            table, group_tables = self._tables(seq)
            state_slot = NO_SLOT if self.recurrent_state is None else self.recurrent_state.state_slot(seq)
            out.seqs.append(ScheduledSeq(request.request_id, seq.seq_id, seq.token_ids[start:start + n], start,
                                         table, group_block_tables=group_tables, lora_slot=request.lora_slot or 0,
                                         state_slot=state_slot))
            row = len(out.seqs) - 1
            out.prompt_logprob_rows += [PromptLogprobRow(row, p, seq.token_ids[p + 1], k)
                                        for p in prompt_logprobs.wanted(request, seq, start, n)]
            if samples:
                indices = range(request.sampling_params.n) if first_of_many else [seq.index]
                out.sample_rows += [SampleRow(row, index) for index in indices]
        return n * len(seqs)

    # LoRA: a running request pins its adapter's device slot
    def _pin_lora(self, request: Request) -> bool:
        """Pins a device slot for the request's adapter (True without one); False when every slot
        is pinned by running requests."""
        if request.lora_request is None or request.lora_slot is not None:
            return True
        request.lora_slot = self.lora_slots.acquire(request.lora_request)
        return request.lora_slot is not None

    def _unpin_lora(self, request: Request) -> None:
        if request.lora_slot is not None:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = None

    # KV-cache groups: a model with sliding-window layers may keep several block tables per sequence
    def _tables(self, seq: Sequence) -> tuple[list[int], list[list[int]]]:
        """Copies of the sequence's block table and those of the other KV-cache groups."""
        return list(self.kv_cache.block_table(seq)), [list(t) for t in self.kv_cache.group_block_tables(seq)]

    def _swap_tables(self, seqs: list[Sequence]) -> dict[tuple[int, int], list[int]]:
        """Every block table of these sequences, by (seq_id, KV-cache group)."""
        return {(s.seq_id, g): table for s in seqs
                for g, table in enumerate([self.kv_cache.block_table(s)] + self.kv_cache.group_block_tables(s))}

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """All of the request's blocks go back (to the host first, when swapping); it waits at the front."""
        seqs = request.live_seqs
        pairs = None
        if self.preemption_mode == "swap":
            pairs = self.swap_space.swap_out(request.request_id, self._swap_tables(seqs))
        if pairs is not None:
            out.swap_out += pairs
            self.num_swap_outs += 1
        for seq in request.seqs:
            self.kv_cache.free(seq)
            if pairs is None:
                seq.num_computed_tokens = 0
        self._unpin_lora(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request.request_id)

    def preempt_all(self) -> None:
        """Every running request goes back to waiting to recompute (after the KV pool was lost)."""
        while self.running:
            request = self.running.pop()
            for seq in request.seqs:
                self.kv_cache.free(seq)
                seq.num_computed_tokens = 0
            self._unpin_lora(request)
            self.waiting.appendleft(request)

    # Phase 2: apply the step's results -----------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result, step_index: int = 0
                           ) -> list[tuple[Request, list[Sequence]]]:
        """Applies step ``step_index`` of ``out`` (0, or a later step of a decode window): one
        sampled token per sample row (``result.tokens``, ``.logprobs``, ``.top_ids``,
        ``.top_logprobs``; ``.prompt_logprobs``). Returns each request of the step that is still
        scheduled with the sequences that received a token; finished requests are already freed.
        Rows of sequences that ended in an earlier step of the window are skipped.

        A step that verified proposals (``result.num_accepted``) is applied one position at a time
        too (``step_index`` 0 .. ``result.num_token_steps - 1``): at position j a sequence takes
        its row ``spec_index == j`` if it accepted at least j proposals (its K/V up to there is
        valid), so stops and stop strings end it at exactly the token they would without
        speculation; after its last token the blocks past its tokens are freed."""
        accepted = result.num_accepted
        if step_index == 0 and accepted is not None:
            self._record_verification(out, result)
        if step_index == 0 and out.prompt_logprob_rows:
            rows = out.prompt_logprob_rows
            prompt_logprobs.record([(self.requests[out.seqs[r.seq_row].request_id], r.position, r.num_logprobs)
                                    for r in rows], [r.target for r in rows], result.prompt_logprobs)
        position = 0 if accepted is None else step_index  # the spec_index of the rows applied now
        takes = [accepted is None or accepted[i] >= step_index for i in range(len(out.seqs))]
        rows_by_request: dict[str, list[int]] = {}
        for i, row in enumerate(out.sample_rows):
            if takes[row.seq_row] and row.spec_index == position:
                rows_by_request.setdefault(out.seqs[row.seq_row].request_id, []).append(i)
        seq_rows: dict[str, list[int]] = {}
        for i, scheduled in enumerate(out.seqs):
            if takes[i]:
                seq_rows.setdefault(scheduled.request_id, []).append(i)
        advanced = []
        for sr in out.requests:
            request = self.requests.get(sr.request_id)
            if request is None or sr.request_id not in seq_rows:  # ended earlier in the window, or
                continue                                           # has taken its accepted tokens
            seq_ids = {out.seqs[i].seq_id for i in seq_rows[sr.request_id]}
            live = [s for s in request.seqs if s.seq_id in seq_ids and not s.finished]
            for seq in live:  # later positions of a window or a verification: one token each
                seq.num_computed_tokens += sr.num_new_tokens if step_index == 0 else 1
            rows = [i for i in rows_by_request.get(sr.request_id, ())
                    if step_index == 0 or not self._seq(out, out.sample_rows[i].seq_row).finished]
            new = []
            if request.beam is not None and rows:
                new = self._beam_step(request, [self._seq(out, out.sample_rows[i].seq_row) for i in rows],
                                      [(result.top_ids[i], result.top_logprobs[i]) for i in rows])
            elif rows:
                new = self._append_samples(
                    request, [(self._seq(out, out.sample_rows[i].seq_row), out.sample_rows[i].sample_index)
                              for i in rows],
                    [(int(result.tokens[i]), float(result.logprobs[i]), result.top_ids[i], result.top_logprobs[i])
                     for i in rows])
            if accepted is not None:  # a sequence's last token of the step: rejected slots go back
                for i in seq_rows[sr.request_id]:
                    if accepted[i] == step_index:
                        self.speculation.rollback(out.seqs[i], self._seq(out, i))
            self._free_finished(request)
            advanced.append((request, new))
        return advanced

    def _record_verification(self, out: SchedulerOutput, result) -> None:
        """Acceptance stats, and the draft model's proposals for each sequence's next step."""
        for i, scheduled in enumerate(out.seqs):
            if scheduled.request_id in self.requests:
                drafts = None if result.draft_token_ids is None else result.draft_token_ids[i]
                self.speculation.record(scheduled, self._seq(out, i), int(result.num_accepted[i]), drafts)

    def _append_samples(self, request: Request, rows: list[tuple[Sequence, int]], samples: list) -> list[Sequence]:
        """Appends a request's sampled tokens; forks the prompt sequence on its first n > 1 sample."""
        seqs = [seq for seq, _ in rows]
        if len(rows) > 1 and len(request.seqs) == 1:
            parent = request.seqs[0]
            for k, (_, sample_index) in enumerate(rows[1:], start=1):
                child = parent.fork(sample_index)
                self.kv_cache.fork(parent, child)
                request.seqs.append(child)
                seqs[k] = child
        for seq, (token, logprob, top_ids, top_lps) in zip(seqs, samples):
            seq.append_token(token, logprob, top_ids, top_lps, request.sampling_params.logprobs)
            self._check_stop(request, seq, token)
        return seqs

    def _check_stop(self, request: Request, seq: Sequence, token: int) -> None:
        params = request.sampling_params
        if seq.structured is not None and seq.structured.error:  # never reported as a normal stop
            seq.finish_reason, seq.stop_reason = "error", f"structured_outputs: {seq.structured.error}"
            return
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

    def _beam_step(self, request: Request, parents: list[Sequence], tops: list) -> list[Sequence]:
        """Picks the next beams; a beam chosen twice forks (shares blocks), one not chosen is freed."""
        state = request.beam
        width = 2 * state.params.beam_width
        candidates = [beam_search.Candidate(seq.cumulative_logprob + float(lp), seq, int(t))
                      for seq, (top_ids, top_lps) in zip(parents, tops)
                      for t, lp in zip(top_ids[:width], top_lps[:width])]
        chosen = beam_search.select(state, candidates, parents[0].num_output_tokens, request.eos_token_ids)
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

    def stop_sequences(self, stops: list[tuple[Request, Sequence, str]]) -> None:
        """Ends sequences at stop strings (found by the output processor): each finishes with
        ``"stop"`` and its stop string; blocks are freed, requests whose sequences all ended too."""
        for request, seq, stop in stops:
            seq.finish_reason, seq.stop_reason = "stop", stop
            self._free_finished(request)

    def finish(self, request: Request) -> None:
        """Frees a finished or aborted request, wherever it is (its host copy too)."""
        self.swap_space.free(request.request_id)
        self._unpin_lora(request)
        for seq in request.seqs:
            self.kv_cache.free(seq)
        self.requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
