"""Hermes format (Qwen2.5, Qwen3, SmolLM3, Hermes 2/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call, text around them is content. An unclosed last block (EOS before ``</tool_call>``) is read too."""
import re

from jpaged.agents.tool_parsers.base import MalformedCall, ToolParser, join_outside, json_values, make_call
from jpaged.agents.tool_parsers.partial import json_call

BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def parse(self, text):
        segments, calls, start = [], [], 0
        for m in BLOCK.finditer(text):
            segments.append(text[start:m.start()])
            start = m.end()
            values = json_values(m.group(1))
            if len(values) != 1 or not isinstance(values[0], dict):
                raise MalformedCall("a <tool_call> block is not one JSON object")
            calls.append(make_call(values[0].get("name"), values[0].get("arguments", values[0].get("parameters"))))
        segments.append(text[start:])
        return join_outside(segments), calls

    def partial_calls(self, text):
        calls = []
        for m in re.finditer("<tool_call>", text):
            call, _ = json_call(text, m.end())
            if call is None:
                break
            calls.append(call)
        return calls
