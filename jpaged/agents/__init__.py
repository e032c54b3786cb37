"""Agents: tool calling and reasoning output, shared by ``LLM.chat`` and the OpenAI server.

One package rather than two under ``entrypoints/``: the offline API uses the same request checks,
grammars and parsers as the server, and neither imports the other.

- `tools`: the request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked into a
  `ToolRequest`; for ``"required"`` and a named function, the grammar that admits only calls.
- `tool_parsers`: model output text -> tool calls, one format per file, a registry by name.
- `reasoning_parsers`: the ``<think>...</think>`` part of the output, split off as reasoning.
- `chat_output`: both together, streamed (OpenAI deltas) or whole, from one state machine so that a
  stream always accumulates to the non-streaming answer.
"""
