"""A ChatML chat template with tools, in the Hermes format Qwen's templates use.

Plain messages render exactly as ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``);
with ``tools``, a system block lists their JSON schemas and how to call them; an
assistant message's tool calls render as ``<tool_call>{...}</tool_call>`` and a tool's
result as a ``tool`` turn. ``examples/make_model.py --agentic`` gives it to the
tokenizer it writes, with ``<|im_end|>`` as EOS, so that the engine stops at the end
of each turn.
"""

TOOL_CHATML = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call these functions:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}"
    "<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}<tool_call>"
    '{"name": "{{ c[\'function\'][\'name\'] }}", "arguments": '
    "{{ c['function']['arguments'] }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
