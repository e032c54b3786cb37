"""The forced-call format (``tool_choice="required"`` or a named function): the output is a JSON
array of ``{"name", "arguments"}``, which the grammar guarantees; not selectable by name."""
from jpaged.agents.tool_parsers.base import MalformedCall, ToolParser, json_values, make_call
from jpaged.agents.tool_parsers.partial import json_calls, skip_space


class JsonListToolParser(ToolParser):
    name = "json_list"
    markers = ("[",)
    at_start_only = True

    def parse(self, text):
        values = json_values(text)
        if len(values) != 1 or not isinstance(values[0], list) or not values[0] \
                or not all(isinstance(v, dict) for v in values[0]):
            raise MalformedCall("not a JSON array of calls")
        return "", [make_call(v.get("name"), v.get("arguments")) for v in values[0]]

    def partial_calls(self, text):
        i = skip_space(text, 0)
        return json_calls(text, skip_space(text, i + 1), ",") if text.startswith("[", i) else []
