"""Generated text -> an assistant message: reasoning, content and tool calls, streamed or whole.

`ChatOutputStream` is fed the text as it is generated and returns OpenAI delta pieces; the whole
(non-streaming) answer is the same stream fed at once (`parse_chat_output`), so a client that
accumulates the deltas gets exactly the non-streaming message.

Content streams live. Once a tool parser's marker shows up, content is held, and each call is
sent once its name is read and names a function of the request (``index``, ``id``, ``type`` and
name first), then its ``arguments`` in pieces as they are generated (`ToolParser.partial_calls`).
When the sequence ends the whole text is checked: valid calls give ``finish_reason="tool_calls"``;
text that was never sent as a call and is not a valid one (unparsable, an unknown function) is
content. A call already sent whose arguments then fail (not JSON, the schema, cut by
``max_tokens``) stays in ``tool_calls`` as generated (a delta cannot be taken back) and the finish
reason stays ``stop`` / ``length``: only ``"tool_calls"`` promises valid arguments. Forced calls
(``required``, a named function) decode under the grammar, so theirs are valid unless cut.
"""
import json
from dataclasses import dataclass, field

from jpaged.agents.reasoning_parsers import ReasoningParser
from jpaged.agents.tool_parsers import JsonListToolParser, MalformedCall, ToolCall, ToolParser
from jpaged.agents.tool_parsers.base import partial_marker_len
from jpaged.agents.tools import ToolRequest, arguments_valid


@dataclass
class ChatMessage:
    """The parsed assistant message of one choice."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None

    def to_openai(self) -> dict:
        message = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return message


class ToolCallStream:
    """Content until the first tool-call marker (whitespace and a partial marker held back), then
    the calls: each as soon as the parser reads its name (`ToolParser.partial_calls`) and the name is
    a function the request can call, its arguments in pieces as they are generated. `finish` checks
    the whole text."""

    def __init__(self, parser: ToolParser, request: ToolRequest):
        self.parser, self.request = parser, request
        self.text, self.emitted, self.in_calls, self.plain = "", 0, False, False
        self.allowed = {f.name: f for f in request.callable_functions()}
        self.calls: list[ToolCall] = []  # the calls sent so far, their arguments as sent

    def _candidate(self) -> str:
        """The content that is safe to have sent by now."""
        text = self.text
        if self.plain:
            return text
        if self.parser.at_start_only:
            lead = text.lstrip()
            if any(lead.startswith(m) for m in self.parser.markers):
                self.in_calls = True
                return ""
            if not lead or any(m.startswith(lead) for m in self.parser.markers):
                return ""
            self.plain = True  # the calls would have to be the whole output
            return text
        cut = min((i for i in (text.find(m) for m in self.parser.markers) if i >= 0), default=-1)
        if cut >= 0:
            self.in_calls = True
            return text[:cut].rstrip()
        hold = max(partial_marker_len(text, m) for m in self.parser.markers)
        return text[:len(text) - hold].rstrip()

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content to send, ``tool_calls`` delta pieces) for the next piece of text."""
        self.text += delta
        piece = ""
        if not self.in_calls:
            candidate = self._candidate()
            piece = candidate[self.emitted:]
            self.emitted = max(self.emitted, len(candidate))
        return piece, self._call_deltas() if self.in_calls else []

    def _call_deltas(self) -> list[dict]:
        """The pieces of the calls read so far that were not sent yet."""
        deltas = []
        for i, partial in enumerate(self.parser.partial_calls(self.text)):
            if partial.name not in self.allowed or (i > 0 and not self.request.parallel):
                break
            if i == len(self.calls):
                self.calls.append(ToolCall(partial.name, ""))
                deltas.append({"index": i, "id": self.calls[i].id, "type": "function",
                               "function": {"name": partial.name, "arguments": ""}})
            call = self.calls[i]
            if len(partial.arguments) > len(call.arguments):
                deltas.append({"index": i, "function": {"arguments": partial.arguments[len(call.arguments):]}})
                call.arguments = partial.arguments
        return deltas

    def finish(self) -> tuple[str, list[dict], list[ToolCall], bool]:
        """(content not sent yet, the last delta pieces, the calls, whether they are valid). The
        calls are those sent (their arguments as generated) when the text is a valid set of calls;
        a valid set the parser could not stream is sent whole here. Text that is not a valid set of
        calls is content if none of it was sent as a call; calls already sent stay calls (a delta
        cannot be taken back), not valid ones."""
        if not self.in_calls:
            return self.text[self.emitted:], [], [], False
        deltas = self._call_deltas()
        parsed = self._valid_calls()
        if parsed and self._as_sent(parsed):
            content, _ = self.parser.parse(self.text)
            return content[self.emitted:], deltas, list(self.calls), True
        if parsed and not self.calls:
            content, _ = self.parser.parse(self.text)
            self.calls = parsed
            return content[self.emitted:], tool_call_deltas(parsed), list(parsed), True
        if not self.calls:
            return self.text[self.emitted:], [], [], False
        return "", deltas, list(self.calls), False

    def _as_sent(self, parsed: list[ToolCall]) -> bool:
        return len(parsed) == len(self.calls) and all(
            p.name == c.name and json.loads(p.arguments) == _json_or_none(c.arguments)
            for p, c in zip(parsed, self.calls))

    def _valid_calls(self) -> list[ToolCall]:
        """The calls of the whole text when they are valid ones (names the request can call,
        arguments that satisfy their schemas), else none."""
        try:
            _, calls = self.parser.parse(self.text)
        except MalformedCall:
            return []
        if not self.request.parallel:
            calls = calls[:1]  # without parallel_tool_calls, the first call (the only one sent)
        if not calls:
            return []
        for c in calls:
            f = self.allowed.get(c.name)
            if f is None or not arguments_valid(f, json.loads(c.arguments)):
                return []
        return calls


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ChatOutputStream:
    """One choice's text -> delta pieces: ``reasoning_content`` and ``content`` as they come, the
    tool calls at the end. ``tool_parser`` reads ``"auto"`` output; a forced call (``required``, a
    named function) is read as the grammar's JSON array whatever the parser."""

    def __init__(self, reasoning_parser: ReasoningParser | None = None, tool_parser: ToolParser | None = None,
                 tool_request: ToolRequest | None = None):
        self.reasoning_parser = reasoning_parser
        self.text, self.sent_reasoning, self.sent_answer = "", 0, 0
        self.tools = None
        if tool_request is not None and tool_request.forced:
            self.tools = ToolCallStream(JsonListToolParser(), tool_request)
        elif tool_request is not None and tool_request.choice == "auto" and tool_parser is not None:
            self.tools = ToolCallStream(tool_parser, tool_request)
        self.reasoning: str | None = None

    def _split(self, final: bool) -> tuple[str | None, str]:
        if self.reasoning_parser is None:
            return None, self.text
        return self.reasoning_parser.split(self.text, final)

    def _advance(self, final: bool) -> dict:
        reasoning, answer = self._split(final)
        delta = {}
        if reasoning is not None:
            self.reasoning = reasoning
            if len(reasoning) > self.sent_reasoning:
                delta["reasoning_content"] = reasoning[self.sent_reasoning:]
                self.sent_reasoning = len(reasoning)
        new = answer[self.sent_answer:]
        self.sent_answer = max(self.sent_answer, len(answer))
        content, calls = self.tools.feed(new) if self.tools is not None else (new, [])
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def feed(self, delta_text: str) -> dict:
        self.text += delta_text
        return self._advance(final=False)

    def finish(self, finish_reason: str | None) -> tuple[dict, list[ToolCall], str | None]:
        """The last delta pieces, the tool calls (all of them, as their deltas add up), and the
        finish reason (``"tool_calls"`` when the calls are valid ones)."""
        delta = self._advance(final=True)
        calls, valid = [], False
        if self.tools is not None:
            rest, pieces, calls, valid = self.tools.finish()
            merge_delta(delta, {"content": rest, "tool_calls": pieces})
        if valid and finish_reason in ("stop", None):
            finish_reason = "tool_calls"
        return delta, calls, finish_reason


def merge_delta(delta: dict, more: dict) -> dict:
    """Appends ``more``'s pieces (text, or lists of tool-call pieces) to ``delta``'s, empty ones left out."""
    for key, piece in more.items():
        if piece:
            delta[key] = delta.get(key, type(piece)()) + piece
    return delta


def parse_chat_output(text: str, finish_reason: str | None, reasoning_parser=None, tool_parser=None,
                      tool_request=None) -> ChatMessage:
    """The whole assistant message: the stream of `ChatOutputStream` fed at once."""
    stream = ChatOutputStream(reasoning_parser, tool_parser, tool_request)
    first = stream.feed(text)
    last, calls, finish_reason = stream.finish(finish_reason)  # the calls are those the deltas add up to
    content = first.get("content", "") + last.get("content", "")
    reasoning = (first.get("reasoning_content", "") + last.get("reasoning_content", "")) \
        if stream.reasoning is not None else None
    return ChatMessage(content if content or not calls else None, reasoning, calls, finish_reason)


def tool_call_deltas(calls: list[ToolCall]) -> list[dict]:
    """OpenAI's streamed form of the calls: per call its ``index``, ``id``, ``type`` and name first,
    then the arguments text."""
    deltas = []
    for i, c in enumerate(calls):
        deltas.append({"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
        deltas.append({"index": i, "function": {"arguments": c.arguments}})
    return deltas
