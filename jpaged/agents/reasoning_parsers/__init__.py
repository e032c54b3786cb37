"""Reasoning parsers by name (``--reasoning_parser``, ``LLM.chat(reasoning_parser=...)``)."""
from jpaged.agents.reasoning_parsers.base import ReasoningParser
from jpaged.agents.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from jpaged.agents.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r}: must be one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()


__all__ = ["REASONING_PARSERS", "get_reasoning_parser", "ReasoningParser"]
