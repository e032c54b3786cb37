"""Shared by the tool-calling and reasoning tests: a hermes-style (ChatML) chat template with tools,
the functions the tests call, stream accumulation as the openai client does it, and jsonschema checks."""
import json

import jsonschema

from jpaged.agents.templates import CHATML_TOOLS_TEMPLATE

HERMES_TEMPLATE = CHATML_TOOLS_TEMPLATE

PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 6, "pattern": "^[A-Z]+$"}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CONVERSATION = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def assert_valid_calls(tool_calls, schemas=SCHEMAS):
    """Every call names a given function and its arguments (JSON text) satisfy its schema."""
    assert tool_calls
    for call in tool_calls:
        call = call if isinstance(call, dict) else call.model_dump()
        assert call["type"] == "function" and call["id"].startswith("call_")
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, schemas[name])


def accumulate(chunks) -> tuple[dict, str | None]:
    """The message a client builds from streamed chat chunks (openai objects), and the finish reason."""
    message, calls, finish = {"content": "", "reasoning_content": None}, {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            if d.content:
                message["content"] += d.content
            reasoning = (d.model_extra or {}).get("reasoning_content")
            if reasoning:
                message["reasoning_content"] = (message["reasoning_content"] or "") + reasoning
            for t in d.tool_calls or ():
                call = calls.setdefault(t.index, {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                call["id"] = t.id or call["id"]
                if t.function is not None:
                    call["function"]["name"] += t.function.name or ""
                    call["function"]["arguments"] += t.function.arguments or ""
            finish = choice.finish_reason or finish
    message["tool_calls"] = [calls[i] for i in sorted(calls)] or None
    return message, finish


def as_message(message) -> dict:
    """A non-streamed openai message in `accumulate`'s shape (the ids aside)."""
    calls = [c.model_dump(include={"id", "type", "function"}) for c in message.tool_calls or ()]
    return {"content": message.content or "", "reasoning_content": (message.model_extra or {}).get("reasoning_content"),
            "tool_calls": calls or None}


def without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{**c, "id": None} for c in message["tool_calls"] or ()] or None}
