"""What speculative decoding adds to a scheduled step, and takes back after it (host only).

After the scheduler has given every running request the tokens it needs and admitted what fits,
`Speculation.add_proposals` gives each decoding sequence up to ``num_speculative_tokens``
proposals (prompt lookup, or the draft model's from the previous step), within what is left of
the step's token budget and of the free blocks: proposals never preempt, never delay an
admission, and a sequence whose slots cannot be reserved just decodes one token. Their slots are
reserved past the step's own (`KVCacheManager.reserve_slots`: not registered in the prefix cache,
never copied), each proposal gets a sample row that verifies the next, and with a draft model
every sampling sequence also reserves the slots its next proposals are written to.

After the step (`Scheduler.update_from_output`) the accepted tokens are appended one position at
a time, the stats counted, and `rollback` returns the blocks past the sequence's tokens: blocks
that held only rejected proposals (or the draft's look-ahead) are free again at once.
"""
from jpaged.core.scheduler_output import SampleRow
from jpaged.spec_decode.config import SpeculativeConfig
from jpaged.spec_decode.ngram_proposer import NgramProposer
from jpaged.spec_decode.stats import SpecDecodeStats


class ProposedSequence:
    """A sequence as it is once its first proposals are accepted: what a verification row samples
    after (its steps, penalties and bans count the proposals). Rows of grammar-constrained
    requests never speculate, so it has no grammar state."""

    structured = None

    def __init__(self, seq, proposals: list[int]):
        self.seq_id, self.num_prompt_tokens = seq.seq_id, seq.num_prompt_tokens
        self.token_ids = seq.token_ids + proposals

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class Speculation:
    def __init__(self, config: SpeculativeConfig, kv_cache, max_model_len: int):
        self.config, self.kv_cache, self.max_model_len = config, kv_cache, max_model_len
        self.ngram = None
        if config.method == "ngram":
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                       config.num_speculative_tokens)
        self.stats = SpecDecodeStats()

    @staticmethod
    def speculates(request) -> bool:
        """Whether a request's sequences take proposals: not one whose grammar state follows each
        token on the host, and not the first sampling step of an ``n > 1`` request (its samples
        fork after it)."""
        return request.grammar is None and request.beam is None and (
            len(request.seqs) > 1 or request.sampling_params.n == 1)

    def add_proposals(self, out, requests: dict, budget: int) -> None:
        """Adds proposals (and draft look-ahead) to the sequences of ``out`` that sample, within
        ``budget`` tokens. ``requests``: every scheduled request by id."""
        disabled = self.config.disable_by_batch_size is not None and \
            len(out.seqs) > self.config.disable_by_batch_size
        rows_of = {}
        for row in out.sample_rows:
            rows_of.setdefault(row.seq_row, []).append(row)
        candidates = []
        for seq_row, rows in rows_of.items():
            scheduled = out.seqs[seq_row]
            request = requests[scheduled.request_id]
            if len(rows) == 1 and self.speculates(request):
                seq = next(s for s in request.seqs if s.seq_id == scheduled.seq_id)
                candidates.append((scheduled, request, seq, rows[0]))
        if disabled or not candidates:
            return
        share = budget // len(candidates)
        lookahead = self.config.num_lookahead_tokens
        for scheduled, request, seq, row in candidates:
            room = self._room(request, seq)  # tokens this step may still produce past its first
            decoding = len(scheduled.token_ids) == 1
            k = min(self.config.num_speculative_tokens, share, room) if decoding else 0
            proposals = self._proposals(seq, k) if k > 0 else []
            ahead = lookahead if room > len(proposals) + lookahead else 0
            while (proposals or ahead) and not self.kv_cache.reserve_slots([seq], len(scheduled.token_ids) + len(proposals) + ahead):
                if ahead:
                    ahead = 0
                else:
                    proposals = []
            if not (proposals or ahead):
                continue
            scheduled.spec_token_ids, scheduled.num_lookahead_tokens = proposals, ahead
            scheduled.block_table = list(self.kv_cache.block_table(seq))
            scheduled.group_block_tables = [list(t) for t in self.kv_cache.group_block_tables(seq)]
            out.sample_rows += [SampleRow(row.seq_row, row.sample_index, j) for j in range(1, len(proposals) + 1)]

    def _room(self, request, seq) -> int:
        """Tokens a sequence may still get after the next one (``max_tokens``, ``max_model_len``)."""
        p = request.sampling_params
        room = self.max_model_len - seq.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - seq.num_output_tokens - 1)
        return room

    def _proposals(self, seq, k: int) -> list[int]:
        if self.ngram is not None:
            return self.ngram.propose(seq.token_ids, k)
        proposals, seq.draft_token_ids = seq.draft_token_ids[:k], []  # each set is verified once
        return proposals

    @staticmethod
    def row_sequence(seq, scheduled, spec_index: int):
        """The sequence a sample row samples after (`ProposedSequence` for a verification row)."""
        return seq if not spec_index else ProposedSequence(seq, scheduled.spec_token_ids[:spec_index])

    def record(self, scheduled, seq, num_accepted: int, draft_token_ids) -> None:
        """After the step (before its tokens are applied): the stats, and the draft model's
        proposals for the sequence's next step."""
        self.stats.add(len(scheduled.spec_token_ids), num_accepted)
        if draft_token_ids is not None and scheduled.num_lookahead_tokens:
            seq.draft_token_ids = [int(t) for t in draft_token_ids]

    def rollback(self, scheduled, seq) -> None:
        """Frees the blocks past the sequence's tokens once it has taken its last token of the step
        (those of rejected proposals and of the draft's look-ahead)."""
        if (scheduled.spec_token_ids or scheduled.num_lookahead_tokens) and not seq.finished:
            self.kv_cache.free_blocks_past(seq, seq.num_tokens)
