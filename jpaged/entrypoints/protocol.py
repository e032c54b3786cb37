"""OpenAI request shapes (pydantic) and their translation to `SamplingParams`.

Unknown fields are ignored, as most OpenAI-compatible servers do. Beyond OpenAI's fields
(``logit_bias``, ``response_format`` among them), the sampling knobs jpaged has are accepted too, with
vLLM's names (``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``stop_token_ids``,
``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``allowed_token_ids``,
``bad_words``, ``structured_outputs``, ``prompt_logprobs`` for completions, ``cache_salt``; pass them
with ``extra_body``). Chat takes OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
(checked in `jpaged.agents.tools`).
"""
import dataclasses
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt, create_model

from jpaged.sampling_params import PER_ROW_OPTIONS, SamplingParams, StructuredOutputsParams


class APIError(Exception):
    """A request the server refuses: its HTTP status and OpenAI error body fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_response(status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
    """An OpenAI error body with ``status``."""
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}},
                        status_code=status)


class StreamOptions(BaseModel):
    include_usage: bool = False


def _per_row_option_fields() -> dict:
    """A request field per per-row sampling option (`PER_ROW_OPTIONS`: temperature, top_p, top_k,
    min_p, min_tokens, the penalties), named and typed as its `SamplingParams` field; unset (None):
    that field's default."""
    types = {f.name: f.type for f in dataclasses.fields(SamplingParams)}
    return {name: (types[name] | None, None) for name in PER_ROW_OPTIONS}


_PerRowOptions = create_model("_PerRowOptions", __config__=ConfigDict(extra="ignore"), **_per_row_option_fields())


class _SamplingRequest(_PerRowOptions):
    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None  # token ids: real integers (not true, 1.0 or "1")
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, Any] | None = None      # OpenAI: token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None  # OpenAI: {"type": "text" | "json_object" | "json_schema"}
    structured_outputs: dict[str, Any] | None = None  # vLLM: {"json" | "regex" | "choice" | "grammar": ...}
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share blocks
    stream: bool = False
    stream_options: StreamOptions | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` or ``response_format`` (not both) as StructuredOutputsParams."""
        if self.structured_outputs is not None and self.response_format is not None \
                and StructuredOutputsParams.from_response_format(self.response_format) is not None:
            raise ValueError("structured_outputs: give either structured_outputs or response_format, not both")
        if self.structured_outputs is not None:
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {sorted(unknown)}; expected json, regex, "
                                 "choice, grammar or json_object")
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except ValueError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        try:
            return StructuredOutputsParams.from_response_format(self.response_format)
        except ValueError as e:
            message = str(e)
            raise ValueError(message if message.startswith("response_format") else f"response_format: {message}") \
                from None

    def _params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
                ) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams' own checks)."""
        per_row = {name: getattr(self, name) for name in PER_ROW_OPTIONS if getattr(self, name) is not None}
        if per_row.get("top_k") == -1:  # vLLM's "every token"
            per_row["top_k"] = 0
        return SamplingParams(
            n=self.n, **per_row, seed=self.seed, max_tokens=max_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias or None, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=self.structured(), prompt_logprobs=prompt_logprobs)

    @property
    def structured_param(self) -> str:
        """The request field a structured-output error is about."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM: each choice's ``prompt_logprobs``
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        """``echo`` with ``logprobs`` asks for the prompt's logprobs too (they lead the choice's logprobs)."""
        if self.suffix:
            raise ValueError("suffix: not supported")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._params(16 if self.max_tokens is None else self.max_tokens, self.logprobs, prompt_logprobs)

    def prompts(self) -> list:
        """The prompts as a list of texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(t, int) for t in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise ValueError("prompt: empty")
        return prompts


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None          # OpenAI: [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: Any = None                  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None  # OpenAI's default: true

    def tool_request(self):
        """The checked tool fields (a ToolRequest), or None without tools; ValueError names the field."""
        from jpaged.agents.tools import parse_tool_request

        return parse_tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
