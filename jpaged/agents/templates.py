"""A ChatML chat template that renders tools and tool calls in the hermes format.

For ChatML models whose own template has no tool support (the embedded SmolLM2-135M-Instruct's
has none): pass it as ``chat_template=`` / ``--chat_template`` to use ``tools``. The tools go into
the system turn as JSON inside ``<tools>``, assistant calls as ``<tool_call>`` blocks, and
``role: "tool"`` results as ``<tool_response>`` in a user turn, as Qwen2.5's template writes them.
"""

CHATML_TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
