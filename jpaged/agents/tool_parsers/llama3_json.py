"""Llama 3.1/3.2 JSON format: the whole output is ``{"name": ..., "parameters": {...}}`` (several
separated by ``;``), optionally after ``<|python_tag|>``."""
from jpaged.agents.tool_parsers.base import MalformedCall, ToolParser, json_values, make_call
from jpaged.agents.tool_parsers.partial import json_calls, skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG, "{")
    at_start_only = True

    def parse(self, text):
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        values = json_values(body, separator=";")
        if not values or not all(isinstance(v, dict) for v in values):
            raise MalformedCall("not a list of call objects")
        return "", [make_call(v.get("name"), v.get("parameters", v.get("arguments"))) for v in values]

    def partial_calls(self, text):
        i = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i += len(PYTHON_TAG)
        return json_calls(text, i, ";")
