"""What the engine hands back to users."""
from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n`` of them per request)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    score: float | None = None  # beam search: the length-normalized score
    # LLM.chat: the answer without reasoning and tool calls, the ``<think>`` part (a reasoning
    # parser), and the tool calls in OpenAI's shape; ``text`` stays the whole generated text
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times of a request (``time.time()`` seconds), as vLLM reports them."""

    arrival_time: float
    first_token_time: float | None = None   # when its first output token was sampled
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at its end)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # SamplingParams.prompt_logprobs


@dataclass
class BeamSequence:
    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float


@dataclass
class BeamSearchOutput:
    """Beams of one prompt, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)
