"""`SpeculativeConfig`: vLLM's ``speculative_config`` shape, validated once.

  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
  {"method": "draft_model", "model": "path/or/preset", "num_speculative_tokens": 4}

Given to ``LLM(speculative_config=...)`` as a dict, a JSON string (the ``--speculative_config``
flag) or a `SpeculativeConfig`.
"""
import json
import numbers
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass
class SpeculativeConfig:
    """How proposals are made and how many a sequence verifies per step.

    ``method``: ``"ngram"`` (prompt lookup: the tokens that followed the latest earlier occurrence
    of the sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens) or
    ``"draft_model"`` (``model``: a path or preset of a smaller model with the target's tokenizer,
    or an NNX model in memory). ``disable_by_batch_size``: a step that runs more sequences than
    this verifies no proposals (a large batch is compute-bound: extra tokens cost their full price).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: object = None
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        def fail(name, why):
            raise ValueError(f"speculative_config.{name}={getattr(self, name)!r}: {why}")

        if self.method not in METHODS:
            fail("method", f"must be one of {', '.join(map(repr, METHODS))}")
        k = self.num_speculative_tokens
        if not (_is_int(k) and 1 <= k <= 16):
            fail("num_speculative_tokens", "must be an integer from 1 to 16")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 1):
                fail(name, "must be an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            fail("prompt_lookup_min", f"must not exceed prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft_model" and self.model is None:
            fail("model", "method='draft_model' needs a draft model (a path, a preset or an NNX model)")
        if self.method == "ngram" and self.model is not None:
            fail("model", "method='ngram' proposes from the sequence itself and takes no model")
        if self.disable_by_batch_size is not None and not (
                _is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1):
            fail("disable_by_batch_size", "must be None or an integer >= 1")

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """A config from a `SpeculativeConfig`, a dict or its JSON text (None stays None)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: expected a dict or its JSON text, got {type(value).__name__}")
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {sorted(unknown)}")
        return cls(**value)

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past a step's tokens that the draft model writes while it proposes for the next
        step (0 for prompt lookup, which computes nothing)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0
