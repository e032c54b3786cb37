"""Qwen3 (and QwQ-style models that write both tags): reasoning only in an output that begins ``<think>``."""
from jpaged.agents.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False
