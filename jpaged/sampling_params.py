"""Per-request generation settings, validated once when the request is made.

Every field is type-checked: a bad value raises ``ValueError`` naming the field. Checks that need
the model's vocabulary are in ``validate_for_vocab``; the engine's input processor runs them, and
tokenizes ``bad_words`` and compiles ``structured_outputs``, when a request is added.

From an OpenAI request (the server's mapping): ``temperature``, ``top_p``, ``n``, ``seed``,
``stop``, ``presence_penalty``, ``frequency_penalty``, ``max_tokens`` / ``max_completion_tokens``
-> the fields of the same name; ``logprobs`` + ``top_logprobs`` (chat) or ``logprobs`` (completions)
-> ``logprobs``; ``echo`` with ``logprobs`` (completions) -> ``prompt_logprobs``;
``logit_bias`` (string ids -> bias in [-100, 100]) -> ``logit_bias`` as given;
``response_format`` -> ``structured_outputs=StructuredOutputsParams.from_response_format(rf)``;
vLLM's extra fields ``structured_outputs``, ``allowed_token_ids``, ``bad_words``, ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos`` -> the fields of the same name.
"""
import json
import math
import numbers
import re
from dataclasses import dataclass, field, fields

from jpaged.utils import invalid_text_path


_ASCII_INT = re.compile(r"-?[0-9]{1,18}")  # not str.isdigit: "²" and "١" are digits to it
INT32_MAX = 2**31 - 1


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    """A finite int or float (not a bool, not NaN or infinite)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class StructuredOutputsParams:
    """Constrains decoding so the output always parses: set exactly one of

    - ``json``: a JSON schema (dict or JSON text); the output is JSON valid against it;
    - ``regex``: the output matches the pattern in full (Rust regex syntax);
    - ``choice``: the output is one of these strings;
    - ``grammar``: an EBNF grammar (llama.cpp GBNF or Lark syntax); the output is in its language;
    - ``json_object=True``: the output is some JSON object.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        def fail(name, why):
            raise ValueError(f"StructuredOutputsParams.{name}={getattr(self, name)!r}: {why}")

        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object is not False:
            if self.json_object is not True:
                fail("json_object", "must be a bool")
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: set exactly one of json, regex, choice, grammar, "
                             f"json_object (got {given or 'none'})")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except json.JSONDecodeError as e:
                    fail("json", f"not valid JSON ({e})")
            if not isinstance(self.json, (dict, bool)):
                fail("json", "must be a JSON schema (a dict, or its JSON text)")
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            fail("regex", "must be a non-empty string")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            fail("grammar", "must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not all(isinstance(c, str) and c for c in self.choice):
                fail("choice", "must be a list of non-empty strings")
            self.choice = list(self.choice)
            if not self.choice:
                fail("choice", "must not be empty")
        for name in given:
            path = invalid_text_path(getattr(self, name), f"StructuredOutputsParams.{name}")
            if path is not None:
                raise ValueError(f"{path}: not valid Unicode text (a lone surrogate)")

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what a compiled grammar is cached under."""
        if self.json is not None:  # key order kept: properties are generated in schema order
            return "json", json.dumps(self.json)
        if self.json_object:
            return "json", json.dumps({"type": "object"})
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.regex is not None:
            return "regex", self.regex
        return "grammar", self.grammar

    @classmethod
    def from_response_format(cls, response_format: dict | None) -> "StructuredOutputsParams | None":
        """OpenAI ``response_format``: ``{"type": "text"}`` -> None, ``{"type": "json_object"}``,
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``."""
        if response_format is None:
            return None
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise ValueError("response_format.json_schema.schema: missing")
            return cls(json=schema)
        raise ValueError(f"response_format.type={kind!r}: expected 'text', 'json_object' or 'json_schema'")


@dataclass(frozen=True)
class PerRow:
    """Field metadata ``"per_row"`` of a `SamplingParams` option that is a plain scalar per sample
    row of the jitted sampler. The declaration carries it there: `SamplingBatch` gets a list of it and
    `SamplingTensors` an ``[S]`` array of it, each named as the field (`PER_ROW_OPTIONS`), so a new
    per-row option is one field of `SamplingParams` (its validation and its sampler stage aside)."""

    dtype: str                 # numpy dtype of its array: "float32" or "int32"
    pad: float | int           # the padding rows' value, one that changes nothing (temperature 0: greedy)
    clamp: int | None = None   # a larger value is taken as this one (it must fit the dtype)


@dataclass
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy.

    The options, in the order they apply, are listed in docs/sampling.md.
    """

    n: int = field(default=1, metadata={"help": "Samples per prompt (>= 1)"})
    temperature: float = field(default=1.0, metadata={
        "help": "Sampling temperature (>= 0); 0 is greedy", "per_row": PerRow("float32", pad=0.0)})
    top_p: float = field(default=1.0, metadata={
        "help": "Nucleus sampling: the smallest set of tokens holding this probability mass, in (0, 1]",
        "per_row": PerRow("float32", pad=1.0)})
    top_k: int = field(default=0, metadata={
        "help": "Sample from the k most likely tokens (>= 0; 0: all)",
        "per_row": PerRow("int32", pad=0, clamp=INT32_MAX)})  # any k past the vocabulary keeps every token
    min_p: float = field(default=0.0, metadata={
        "help": "Drop tokens less likely than min_p times the most likely one, in [0, 1]",
        "per_row": PerRow("float32", pad=0.0)})
    seed: int | None = field(default=None, metadata={
        "help": "Per-request sampling seed; unset: drawn from the engine's seed"})
    max_tokens: int | None = field(default=16, metadata={"help": "Most new tokens per sequence (>= 1)"})
    min_tokens: int = field(default=0, metadata={
        "help": "New tokens before EOS or a stop may end a sequence (>= 0, at most max_tokens)",
        "per_row": PerRow("int32", pad=0, clamp=INT32_MAX)})  # more than any sequence reaches
    stop: str | list[str] | None = field(default=None, metadata={
        "help": "A string that ends the sequence when generated (not included in the text)"})
    stop_token_ids: list[int] | None = field(default=None, metadata={
        "help": "Token ids that end the sequence when generated, e.g. 2,7"})
    ignore_eos: bool = field(default=False, metadata={"help": "Keep generating past EOS"})
    logprobs: int | None = field(default=None, metadata={
        "help": "Top log-probabilities to return per output token, in [0, 20] (0: the sampled token's only)"})
    presence_penalty: float = field(default=0.0, metadata={
        "help": "Penalty, in [-2, 2], on tokens already in the output", "per_row": PerRow("float32", pad=0.0)})
    frequency_penalty: float = field(default=0.0, metadata={
        "help": "Penalty, in [-2, 2], per occurrence of a token in the output", "per_row": PerRow("float32", pad=0.0)})
    repetition_penalty: float = field(default=1.0, metadata={
        "help": "Repetition penalty (> 0; 1: off): the positive logits of tokens in the prompt or output are "
                "divided by it, the negative ones multiplied", "per_row": PerRow("float32", pad=1.0)})
    skip_special_tokens: bool = field(default=True, metadata={"help": "Leave special tokens out of the text"})
    include_stop_str_in_output: bool = field(default=False, metadata={
        "help": "Keep a stop string (or a stop token's text) in the text"})
    logit_bias: dict[int, float] | None = field(default=None, metadata={
        "help": 'Bias in [-100, 100] added to token ids\' logits, as JSON, e.g. \'{"50256": -100}\''})
    allowed_token_ids: list[int] | None = field(default=None, metadata={
        "help": "Sample only from these token ids, e.g. 11,12,13"})
    bad_words: list[str] | None = field(default=None, metadata={
        "help": "A word that is never generated (alone or after a space)"})
    structured_outputs: StructuredOutputsParams | None = field(default=None, metadata={
        "help": "Constrained decoding as JSON of StructuredOutputsParams' fields, one of json, regex, choice, "
                'grammar, json_object, e.g. \'{"choice": ["yes", "no"]}\' (docs/sampling.md)'})
    prompt_logprobs: int | None = field(default=None, metadata={
        "help": "Top log-probabilities to return per prompt token, in [0, 20]"})

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.logit_bias, dict):  # OpenAI JSON gives the ids as strings (ASCII digits only)
            self.logit_bias = {int(k) if isinstance(k, str) and _ASCII_INT.fullmatch(k.strip()) else k: v
                               for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self):
        def check(ok, name, why):
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        check(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        check(_is_real(self.temperature) and self.temperature >= 0, "temperature", "must be a number >= 0")
        check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be a number in (0, 1]")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0 disables)")
        check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be a number in [0, 1]")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "must be an integer >= 1 or None")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              "must not exceed max_tokens")
        check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
              "logprobs", "must be None or an integer in [0, 20]")
        check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
              "prompt_logprobs", "must be None or an integer in [0, 20]")
        for name in ("presence_penalty", "frequency_penalty"):
            check(_is_real(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name, "must be a number in [-2, 2]")
        check(_is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              "must be a number > 0")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(invalid_text_path(self.stop, "stop") is None, "stop", "must be valid Unicode text (no lone surrogate)")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative token ids")
        check(self.seed is None or _is_int(self.seed), "seed", "must be an int or None")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            check(isinstance(getattr(self, name), bool), name, "must be a bool")
        check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(k) and k >= 0 and _is_real(v) and -100 <= v <= 100 for k, v in self.logit_bias.items())),
            "logit_bias", "must map token ids (>= 0) to numbers in [-100, 100]")
        check(self.allowed_token_ids is None or (
            isinstance(self.allowed_token_ids, (list, tuple)) and len(self.allowed_token_ids) > 0
            and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids", "must be a non-empty list of token ids (>= 0)")
        check(self.bad_words is None or (isinstance(self.bad_words, (list, tuple))
                                         and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
              "bad_words", "must be a list of non-empty strings")
        check(invalid_text_path(self.bad_words, "bad_words") is None, "bad_words",
              "must be valid Unicode text (no lone surrogate)")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields)")

    def validate_for_vocab(self, vocab_size: int, tokenizer=None) -> None:
        """The checks that need the model: token ids inside ``[0, vocab_size)``, ``logprobs`` at
        most the vocabulary, a ``tokenizer`` for ``bad_words`` and ``structured_outputs``. Raises
        ValueError before any device work (the engine's input processor then tokenizes
        ``bad_words`` and compiles ``structured_outputs``)."""
        def check(ok, name, why):
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        check(self.logprobs is None or self.logprobs <= vocab_size, "logprobs",
              f"must not exceed the vocabulary size {vocab_size}")
        check(self.prompt_logprobs is None or self.prompt_logprobs <= vocab_size, "prompt_logprobs",
              f"must not exceed the vocabulary size {vocab_size}")
        check(not self.logit_bias or max(self.logit_bias) < vocab_size, "logit_bias",
              f"token ids must be below the vocabulary size {vocab_size}")
        check(not self.allowed_token_ids or max(self.allowed_token_ids) < vocab_size, "allowed_token_ids",
              f"token ids must be below the vocabulary size {vocab_size}")
        check(not self.stop_token_ids or max(self.stop_token_ids) < vocab_size, "stop_token_ids",
              f"token ids must be below the vocabulary size {vocab_size}")
        check(not self.bad_words or tokenizer is not None, "bad_words", "needs a tokenizer (the model has none)")
        check(self.structured_outputs is None or tokenizer is not None, "structured_outputs",
              "needs a tokenizer (the model has none)")

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


PER_ROW_OPTIONS: dict[str, PerRow] = {f.name: f.metadata["per_row"] for f in fields(SamplingParams)
                                       if "per_row" in f.metadata}  # in field order


def bad_word_token_ids(words, tokenizer) -> list[list[int]]:
    """Each bad word as token ids, alone and after a space (as it appears mid-text); duplicates dropped."""
    out = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


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
        if not (_is_int(self.beam_width) and self.beam_width >= 1):
            raise ValueError(f"BeamSearchParams.beam_width={self.beam_width!r}: must be an integer >= 1")
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"BeamSearchParams.max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"BeamSearchParams.ignore_eos={self.ignore_eos!r}: must be a bool")
        if not _is_real(self.length_penalty):
            raise ValueError(f"BeamSearchParams.length_penalty={self.length_penalty!r}: must be a finite number")

    def validate_for_vocab(self, vocab_size: int, tokenizer=None) -> None:
        """Each step ranks every beam's top ``2 * beam_width`` tokens, so that many must exist."""
        if 2 * self.beam_width > vocab_size:
            raise ValueError(f"BeamSearchParams.beam_width={self.beam_width}: 2 * beam_width must not exceed "
                             f"the vocabulary size {vocab_size}")
