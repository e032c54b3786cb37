"""Per-request generation settings, validated once when the request is made."""
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep a stop string (or stop token's text) in .text

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self):
        def check(ok, name, why):
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(self.temperature >= 0, "temperature", "must be >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0 disables)")
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "must be an integer >= 1 or None")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              "must not exceed max_tokens")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
              "logprobs", "must be None or an integer in [0, 20]")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative token ids")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an int or None")

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass
class BeamSearchParams:
    """Beam search settings (deterministic; scores are sums of log-probabilities)."""

    beam_width: int = 4
    max_tokens: int = 32
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        self.validate()

    def validate(self):
        if not (isinstance(self.beam_width, int) and self.beam_width >= 1):
            raise ValueError(f"BeamSearchParams.beam_width={self.beam_width!r}: must be an integer >= 1")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"BeamSearchParams.max_tokens={self.max_tokens!r}: must be an integer >= 1")
