"""Calls read out of text that is still being generated, for streaming their arguments.

A parser's ``partial_calls(text)`` lists the calls whose name is known so far, each with the text
of its arguments up to where the generation is. Read on a longer text, the list only grows and each
call's arguments only grow (a prefix stays a prefix), so the difference between two reads is a
stream delta. JSON formats stream the arguments as the model writes them; the pythonic format a
keyword argument at a time (each written as JSON once its literal is complete).
"""
import ast
import json
import re
from dataclasses import dataclass

# a call object's name, then its arguments (an object): {"name": "f", "arguments": {
JSON_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)")
KEYWORD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*")
CLOSING = {"{": "}", "[": "]", "(": ")"}


@dataclass
class PartialCall:
    """A call being generated: its name and its arguments' JSON text so far (whole once ``closed``)."""

    name: str
    arguments: str
    closed: bool = False


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def value_end(text: str, start: int, quotes: str = '"') -> int | None:
    """The index after the bracketed value opening at ``text[start]`` (strings in ``quotes`` skipped),
    None while it is open."""
    stack, i, quote = [], start, None
    while i < len(text):
        ch = text[i]
        if quote is not None:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in quotes:
            quote = ch
        elif ch in CLOSING:
            stack.append(CLOSING[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    return None


def json_call(text: str, i: int) -> tuple[PartialCall | None, int | None]:
    """The ``{"name": ..., "arguments": {...}}`` object at ``text[i:]`` (after whitespace): the call
    once its name and the start of its arguments are there (else None), and the index after the
    object's closing brace (None while open, or when something else follows its arguments)."""
    m = JSON_HEADER.match(text, skip_space(text, i))
    if m is None:
        return None, None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:
        return None, None
    end = value_end(text, m.end())
    if end is None:
        return PartialCall(name, text[m.end():]), None
    j = skip_space(text, end)
    return PartialCall(name, text[m.end():end], True), (j + 1 if j < len(text) and text[j] == "}" else None)


def json_calls(text: str, i: int, separator: str) -> list[PartialCall]:
    """Call objects from ``text[i:]``, ``separator`` (and whitespace) between them."""
    calls = []
    while True:
        call, end = json_call(text, i)
        if call is None:
            return calls
        calls.append(call)
        if end is None:
            return calls
        i = skip_space(text, end)
        if not text.startswith(separator, i):
            return calls
        i += len(separator)


def pythonic_calls(text: str, i: int) -> list[PartialCall]:
    """``name(key=literal, ...)`` calls from ``text[i:]`` (after the list's ``[``), commas between:
    a call appears with its first complete argument (or its closing parenthesis), its arguments a
    JSON object written a keyword at a time."""
    calls = []
    while True:
        m = NAME.match(text, i)
        if m is None or not text.startswith("(", m.end()):
            return calls
        name, i, pieces = m.group(1), m.end() + 1, []
        while True:
            i = skip_space(text, i)
            if text.startswith(")", i):
                calls.append(PartialCall(name, "{" + ", ".join(pieces) + "}", True))
                i += 1
                break
            k = KEYWORD.match(text, i)
            if k is None:
                return _with(calls, name, pieces)
            end = _literal_end(text, k.end())
            if end is None:
                return _with(calls, name, pieces)
            try:
                value = json.dumps(ast.literal_eval(text[k.end():end].strip()), ensure_ascii=False)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return _with(calls, name, pieces)
            pieces.append(f"{json.dumps(k.group(1))}: {value}")
            i = skip_space(text, end)
            if text.startswith(",", i):
                i += 1
        i = skip_space(text, i)
        if not text.startswith(",", i):
            return calls
        i += 1


def _with(calls: list[PartialCall], name: str, pieces: list[str]) -> list[PartialCall]:
    return calls + [PartialCall(name, "{" + ", ".join(pieces))] if pieces else calls


def _literal_end(text: str, start: int) -> int | None:
    """Where the Python literal at ``text[start:]`` ends: the first top-level ``,`` or ``)`` after
    it (None while neither is there)."""
    i = start
    while i < len(text):
        ch = text[i]
        if ch in "([{\"'":
            end = value_end(text, i, quotes="\"'") if ch in CLOSING else _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if ch in ",)":
            return i
        i += 1
    return None


def _string_end(text: str, start: int) -> int | None:
    quote, i = text[start], start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        i += 1
    return None
