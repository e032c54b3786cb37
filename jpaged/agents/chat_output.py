"""Generated text -> an assistant message: reasoning, content and tool calls, streamed or whole.

`ChatOutputStream` is fed the text as it is generated and returns OpenAI delta pieces; the whole
(non-streaming) answer is the same stream fed at once (`parse_chat_output`), so a client that
accumulates the deltas gets exactly the non-streaming message.

Content streams live. Once a tool parser's marker shows up, the rest is held and parsed when the
sequence ends: valid calls become ``tool_calls`` (``finish_reason="tool_calls"``), and text that is
not a valid call (unparsable, an unknown function, arguments that fail the function's schema) is
sent as content instead, never a half call.
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
    everything held until `finish` parses it."""

    def __init__(self, parser: ToolParser, request: ToolRequest):
        self.parser, self.request = parser, request
        self.text, self.emitted, self.in_calls, self.plain = "", 0, False, False

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

    def feed(self, delta: str) -> str:
        if self.in_calls:
            self.text += delta
            return ""
        self.text += delta
        candidate = self._candidate()
        piece = candidate[self.emitted:]
        self.emitted = max(self.emitted, len(candidate))
        return piece

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls); no calls when the text is not a valid set of them."""
        calls = self._calls() if self.in_calls else []
        if calls:
            content, _ = self.parser.parse(self.text)
        else:
            content = self.text
        return content[self.emitted:], calls

    def _calls(self) -> list[ToolCall]:
        try:
            _, calls = self.parser.parse(self.text)
        except MalformedCall:
            return []
        allowed = {f.name: f for f in self.request.callable_functions()}
        if not calls or (not self.request.parallel and len(calls) > 1):
            return []
        for c in calls:
            f = allowed.get(c.name)
            if f is None or not arguments_valid(f, json.loads(c.arguments)):
                return []
        return calls


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
        content = self.tools.feed(new) if self.tools is not None else new
        if content:
            delta["content"] = content
        return delta

    def feed(self, delta_text: str) -> dict:
        self.text += delta_text
        return self._advance(final=False)

    def finish(self, finish_reason: str | None) -> tuple[dict, list[ToolCall], str | None]:
        """The last delta pieces, the tool calls, and the finish reason (``"tool_calls"`` when there are calls)."""
        delta = self._advance(final=True)
        calls = []
        if self.tools is not None:
            rest, calls = self.tools.finish()
            if rest:
                delta["content"] = delta.get("content", "") + rest
        if calls and finish_reason in ("stop", None):
            finish_reason = "tool_calls"
        return delta, calls, finish_reason


def parse_chat_output(text: str, finish_reason: str | None, reasoning_parser=None, tool_parser=None,
                      tool_request=None) -> ChatMessage:
    """The whole assistant message: the stream of `ChatOutputStream` fed at once."""
    stream = ChatOutputStream(reasoning_parser, tool_parser, tool_request)
    first = stream.feed(text)
    last, calls, finish_reason = stream.finish(finish_reason)
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
