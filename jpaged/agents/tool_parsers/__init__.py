"""Tool parsers by name (``--tool_call_parser``, ``LLM.chat(tool_call_parser=...)``)."""
from jpaged.agents.tool_parsers.base import MalformedCall, ToolCall, ToolParser
from jpaged.agents.tool_parsers.hermes import HermesToolParser
from jpaged.agents.tool_parsers.json_list import JsonListToolParser
from jpaged.agents.tool_parsers.llama3_json import Llama3JsonToolParser
from jpaged.agents.tool_parsers.mistral import MistralToolParser
from jpaged.agents.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r}: must be one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "get_tool_parser", "ToolCall", "ToolParser", "MalformedCall", "JsonListToolParser"]
