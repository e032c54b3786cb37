"""Chat templates: a conversation (a list of ``{"role", "content"}`` messages) to a prompt.

The template is the one given, else the tokenizer's own (a GGUF file's ``tokenizer.chat_template``
metadata or a checkpoint's ``tokenizer_config.json``, both loaded onto the tokenizer). The rendered
text is tokenized without adding special tokens again: the template writes them itself.
"""
from jpaged.utils import check_text

ROLES = ("system", "user", "assistant", "tool", "developer")


def message_text(content, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of ``{"type": "text", "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}.content[{i}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                 "are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")


def normalize_conversation(messages, where: str = "messages") -> list[dict]:
    """Checks a conversation and returns it as plain ``{"role", "content": str}`` dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of {{'role', 'content'}} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"{where}[{i}]: expected a dict with 'role' and 'content'")
        check_text(m, f"{where}[{i}]")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}[{i}].role={m['role']!r}: must be one of {', '.join(ROLES)}")
        out.append({**m, "content": message_text(m.get("content") or "", f"{where}[{i}]")})
    return out


def is_conversation(obj) -> bool:
    """One conversation (a list of message dicts) rather than a list of conversations."""
    return isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(m, dict) for m in obj)


def supports_tools(template: str) -> bool:
    """Whether a chat template renders tool definitions (its source reads the ``tools`` variable)."""
    return "tools" in template


def apply_chat_template(tokenizer, messages, chat_template: str | None = None,
                        add_generation_prompt: bool = True, check_length=None, tools: list[dict] | None = None) -> dict:
    """``{"prompt": text, "prompt_token_ids": ids}`` for one conversation, ready for ``add_request``.

    ``tools`` (OpenAI function tools) reach the template as its ``tools`` variable; assistant
    ``tool_calls`` in the history get their arguments as objects, as templates expect.
    Raises ValueError when there is no tokenizer, no template, a template that cannot render tools
    when there are some, or a malformed conversation; ``check_length(text, field)`` (the input
    processor's) may refuse text too long to tokenize.
    """
    from jpaged.agents.tools import template_messages

    if tokenizer is None:
        raise ValueError("chat: the model has no tokenizer, so it cannot apply a chat template")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("chat_template: the model's tokenizer has no chat template (neither in the GGUF "
                         "metadata nor in tokenizer_config.json); pass chat_template=")
    if tools and not supports_tools(template):
        raise ValueError("tools: the chat template cannot render tools (its source never reads `tools`); "
                         "give one that can (chat_template= or --chat_template)")
    conversation = template_messages(normalize_conversation(messages))
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, tools=tools or None)
    except Exception as e:  # jinja2 errors: a broken template, or raise_exception() in it
        raise ValueError(f"chat_template: could not render the conversation: {e}") from None
    if check_length is not None:
        check_length(text, "messages")
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
