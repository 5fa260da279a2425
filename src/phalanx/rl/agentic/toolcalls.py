"""The model's text as an OpenAI chat message: its content and its tool calls.

Tool calls are read in the Hermes format that Qwen's and most open models'
chat templates use (vLLM's ``hermes`` tool parser reads the same)::

    <tool_call>{"name": "run_python", "arguments": {"code": "print(1)"}}</tool_call>

A block whose JSON does not parse, or names no function, still becomes a tool
call: its ``arguments`` are the raw text, so the environment's own parse fails
and its error message goes back to the model as the tool's result (as
``verifiers``' ``ToolEnv`` does), instead of the episode crashing or the call
vanishing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text of the arguments, as the OpenAI API carries them (or the raw text of
    a call that did not parse)."""


@dataclass
class Parsed:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


def parse_tool_calls(text: str, call_prefix: str) -> Parsed:
    """``text`` split into its content (the tool-call blocks removed) and its calls,
    numbered ``{call_prefix}-{i}``."""
    calls: list[ToolCall] = []
    for i, m in enumerate(CALL.finditer(text)):
        body = m.group(1).strip()
        name, arguments = "", body
        try:
            obj: Any = json.loads(body)
        except ValueError:
            found = NAME.search(body)
            name = found.group(1) if found else ""
        else:
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                name = obj["name"]
                args = obj.get("arguments", {})
                arguments = args if isinstance(args, str) else json.dumps(args)
        calls.append(ToolCall(f"{call_prefix}-{i}", name, arguments))
    content = CALL.sub("", text).strip() if calls else text
    return Parsed(content, calls)
