"""A request and its sequences: token ids, how many are computed, how they ended."""
import copy
import itertools
import time
from dataclasses import dataclass, field

from jpaged.outputs import RequestMetrics
from jpaged.sampling_params import SamplingParams


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One token stream with its own block table (a request has ``n`` of them, or ``beam_width``)."""

    token_ids: list[int]
    num_prompt_tokens: int
    index: int = 0                       # position among the request's outputs
    max_tokens: int | None = None        # the most output tokens it may get (set by the engine)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0         # tokens whose K/V are in the cache
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    structured: object | None = None     # its structured_output.StructuredState (a constrained request)
    detokenizer: object | None = None    # its IncrementalDetokenizer (the output processor's)
    draft_token_ids: list[int] = field(default_factory=list)  # the draft model's proposals for its next step

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fork(self, index: int) -> "Sequence":
        """A copy sharing history; its blocks are shared through the KV cache manager."""
        return Sequence(token_ids=list(self.token_ids), num_prompt_tokens=self.num_prompt_tokens,
                        index=index, max_tokens=self.max_tokens, num_computed_tokens=self.num_computed_tokens,
                        cumulative_logprob=self.cumulative_logprob,
                        logprobs=None if self.logprobs is None else list(self.logprobs),
                        text=self.text,
                        structured=None if self.structured is None else self.structured.fork(),
                        detokenizer=copy.copy(self.detokenizer))

    def append_token(self, token: int, logprob: float, top_ids, top_logprobs, num_logprobs: int | None) -> None:
        """A sampled token, its log-probability and (when asked for) the top ``num_logprobs``."""
        self.token_ids.append(token)
        self.cumulative_logprob += logprob
        if num_logprobs is not None:
            entry = {token: logprob}
            entry.update({int(t): float(lp) for t, lp in zip(top_ids[:num_logprobs], top_logprobs[:num_logprobs])})
            self.logprobs = (self.logprobs or []) + [entry]


@dataclass(eq=False)
class Request:
    """A prompt and the sequences generated from it; scheduled and preempted as one group."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    beam: object | None = None  # a beam_search.BeamState for beam-search requests
    grammar: object | None = None  # structured_output.Grammar compiled from structured_outputs
    bad_word_ids: list[list[int]] = field(default_factory=list)  # bad_words, tokenized
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.time()))
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled by sample.prompt_logprobs
    lora_request: object | None = None  # a `jpaged.lora.LoRARequest`: the adapter it runs with
    lora_slot: int | None = None        # the device slot it pins while running (the scheduler's)

    def __post_init__(self):
        if not self.seqs:
            self.seqs = [Sequence(token_ids=list(self.prompt_token_ids),
                                  num_prompt_tokens=len(self.prompt_token_ids))]

    @property
    def live_seqs(self) -> list[Sequence]:
        if self.beam is not None:
            return [] if self.beam.done else self.seqs
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.finished for s in self.seqs)
