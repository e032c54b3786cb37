"""The ``<think>...</think>`` split shared by the reasoning parsers."""
from jpaged.agents.tool_parsers.base import partial_marker_len


class ReasoningParser:
    """Splits output text into (reasoning, answer) at ``end``.

    ``starts_in_reasoning``: the prompt already opened the thinking (DeepSeek-R1's template ends in
    ``<think>``), so the output is reasoning from its first token, a leading ``start`` tag skipped;
    otherwise only an output that begins with ``start`` has reasoning. Reasoning without ``end`` (cut
    off by max_tokens) is all reasoning. The answer's leading whitespace is dropped.

    `split(text, final=False)` holds back what could still become a tag, so that the parts of a
    prefix are prefixes of the parts of the whole: a stream of their growth is the whole answer.
    """

    name = ""
    start, end = "<think>", "</think>"
    starts_in_reasoning = False

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        lead = text.lstrip()
        if lead.startswith(self.start):
            body = lead[len(self.start):]
        elif not final and self.start.startswith(lead):
            return None, ""  # could still be the start tag
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text
        i = body.find(self.end)
        if i >= 0:
            return body[:i], body[i + len(self.end):].lstrip()
        return body[:len(body) - (0 if final else partial_marker_len(body, self.end))], ""
