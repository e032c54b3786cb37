"""Mistral format: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (v3), or
``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+ tokenizers); the text before it is content."""
from jpaged.agents.tool_parsers.base import MalformedCall, ToolParser, json_values, make_call
from jpaged.agents.tool_parsers.partial import PartialCall, json_calls, skip_space, value_end

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)

    def parse(self, text):
        i = text.find(TOOL_CALLS)
        if i < 0:
            return text, []
        content, rest = text[:i].rstrip(), text[i:]
        pieces = [p for p in rest.split(TOOL_CALLS) if p.strip()]
        if not pieces:
            raise MalformedCall("[TOOL_CALLS] without calls")
        calls = []
        for piece in pieces:
            if ARGS in piece:
                name, arguments = piece.split(ARGS, 1)
                values = json_values(arguments)
                if len(values) != 1:
                    raise MalformedCall("[ARGS] is not one JSON object")
                calls.append(make_call(name.strip(), values[0]))
                continue
            values = json_values(piece)
            items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
            if not items or not all(isinstance(v, dict) for v in items):
                raise MalformedCall("[TOOL_CALLS] is not followed by call objects")
            calls.extend(make_call(v.get("name"), v.get("arguments", v.get("parameters"))) for v in items)
        return content, calls

    def partial_calls(self, text):
        calls, i = [], text.find(TOOL_CALLS)
        while i >= 0:
            start = skip_space(text, i + len(TOOL_CALLS))
            following = text.find(TOOL_CALLS, start)
            piece = text[:following] if following >= 0 else text
            if piece.startswith("[", start):
                found = json_calls(piece, skip_space(piece, start + 1), ",")
            elif ARGS in piece[start:]:
                a = piece.index(ARGS, start)
                found, b = [], skip_space(piece, a + len(ARGS))
                if piece[start:a].strip() and piece.startswith("{", b):
                    end = value_end(piece, b)
                    found = [PartialCall(piece[start:a].strip(), piece[b:end or len(piece)], end is not None)]
            else:
                found = json_calls(piece, start, ",")
            calls += found
            if not found:
                break
            i = following
        return calls
