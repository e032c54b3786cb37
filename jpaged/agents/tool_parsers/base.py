"""What every tool parser shares: the parsed call, the content around calls, the base class."""
import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One parsed call; ``arguments`` is JSON text, as OpenAI returns it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class MalformedCall(ValueError):
    """The text holds a tool-call marker but not a call the parser can read: it stays text."""


def make_call(name, arguments) -> ToolCall:
    """A call from a parsed name and its arguments (an object, or JSON text of one)."""
    if not isinstance(name, str) or not name:
        raise MalformedCall("a call without a name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise MalformedCall(f"{name}: arguments are not JSON") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise MalformedCall(f"{name}: arguments are not an object")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def join_outside(segments: list[str]) -> str:
    """The text outside the calls (``segments[k]`` lies between call k-1 and call k): the whitespace
    next to a call dropped, the rest kept as it is."""
    if len(segments) == 1:
        return segments[0]
    parts = [segments[0].rstrip()] + [s.strip() for s in segments[1:-1]] + [segments[-1].lstrip()]
    return "\n".join(p for p in parts if p)


def json_values(text: str, separator: str = "") -> list:
    """The JSON values ``text`` is made of (whitespace and ``separator`` between them); MalformedCall if
    anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (separator and text.startswith(separator, i))):
            i += len(separator) if separator and text.startswith(separator, i) else 1
        if i >= len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):
            raise MalformedCall("not JSON") from None
        values.append(value)


class ToolParser:
    """Reads one model family's tool-call format out of generated text.

    ``markers``: the strings that begin the calls; with ``at_start_only`` the calls are the whole
    output, so a marker counts only as its first non-whitespace text. `parse` returns
    ``(content, calls)`` and raises MalformedCall for text that starts calls it cannot read;
    `partial_calls` the calls of text still being generated (`partial.PartialCall`), whose
    arguments are streamed.
    """

    name = ""
    markers: tuple[str, ...] = ()
    at_start_only = False

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def partial_calls(self, text: str) -> list:
        """The calls of ``text`` read so far, in order (a format that cannot be read before it ends
        lists none: its calls are sent whole at the end)."""
        return []
