"""Pythonic format (Llama 3.2 / 4 pythonic, ToolACE): the whole output is a Python list of calls,
``[get_weather(city="Paris"), get_time()]``, arguments as Python literals."""
import ast

from jpaged.agents.tool_parsers.base import MalformedCall, ToolParser, make_call
from jpaged.agents.tool_parsers.partial import pythonic_calls, skip_space

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    name = "pythonic"
    markers = ("[", PYTHON_START)
    at_start_only = True

    def parse(self, text):
        body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise MalformedCall("not a Python list of calls") from None
        if not isinstance(tree, ast.List) or not tree.elts:
            raise MalformedCall("not a Python list of calls")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise MalformedCall("a list item is not name(keyword=value, ...)")
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            except (ValueError, TypeError, SyntaxError, RecursionError):
                raise MalformedCall(f"{node.func.id}: an argument is not a literal") from None
            calls.append(make_call(node.func.id, arguments))
        return "", calls

    def partial_calls(self, text):
        i = skip_space(text, 0)
        if text.startswith(PYTHON_START, i):
            i = skip_space(text, i + len(PYTHON_START))
        return pythonic_calls(text, i + 1) if text.startswith("[", i) else []
