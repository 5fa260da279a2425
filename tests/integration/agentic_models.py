"""Models and environments for the agentic tests: a small Qwen2 with the tool-calling
tokenizer of ``examples/make_model.py --agentic``, taught (a few seconds of supervised
training on CPU) to call a tool and then answer, so that a greedy episode really takes
two turns; and ``verifiers`` environments to run it in.

Importable by the tests and, on PYTHONPATH, by the replicas they start
(``rl.env.module = "agentic_models"``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]

QUESTION = "say hi"
CALL = '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
ANSWER = "hi"


def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: what to echo
    """
    return f"echo: {text}"


def tool_conversation() -> list[dict[str, Any]]:
    """The conversation the taught model reproduces: a tool call, its result, an answer."""
    return [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c0",
                    "type": "function",
                    "function": {"name": "echo", "arguments": '{"text": "hi"}'},
                }
            ],
        },
        {"role": "tool", "content": echo("hi"), "tool_call_id": "c0"},
        {"role": "assistant", "content": ANSWER},
    ]


def make_agentic_model(out: Path) -> Path:
    """``examples/make_model.py --agentic``: random weights, head size 32 (vLLM's CPU
    attention takes it)."""
    args = ["--agentic", "--hidden", "64", "--layers", "2", "--heads", "2", "--vocab", "512"]
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_model.py"), str(out), *args],
        check=True,
        capture_output=True,
    )
    return out


def teach(model_dir: Path, out: Path, steps: int = 600) -> Path:
    """``model_dir`` trained on :func:`tool_conversation`'s assistant turns until greedy
    decoding reproduces them, saved to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verifiers.utils.tool_utils import convert_func_to_oai_tool

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    tools = [convert_func_to_oai_tool(echo)]
    text = tok.apply_chat_template(tool_conversation(), tools=tools, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    start = tok.convert_tokens_to_ids("<|im_start|>")
    end = tok.eos_token_id
    # Train on the assistant turns only: from after "<|im_start|>assistant\n" to EOS.
    head = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    labels = [-100] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i] == start and ids[i : i + len(head)] == head:
            j = i + len(head)
            while j < len(ids) and ids[j] != end:
                labels[j] = ids[j]
                j += 1
            if j < len(ids):
                labels[j] = ids[j]
            i = j
        i += 1
    x = torch.tensor([ids])
    y = torch.tensor([labels])
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-4:
            break
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def load_environment(kind: str = "tool", max_turns: int = 4, rows: int = 4) -> Any:
    """``tool``: a ToolEnv with :func:`echo`, rewarded 1 for an answer saying hi;
    ``talk``: a MultiTurnEnv that answers every turn, for ``max_turns`` turns (a
    random model gets as many turns as it is given); ``broken``: not an environment."""
    import verifiers as vf
    from datasets import Dataset

    if kind == "broken":
        return {"not": "an environment"}
    data = Dataset.from_list([{"question": QUESTION, "answer": ANSWER}] * rows)

    def said_it(completion: Any, answer: str) -> float:
        last = [m for m in completion if m.get("role") == "assistant"][-1:]
        return float(bool(last) and answer in str(last[0].get("content") or ""))

    rubric = vf.Rubric(funcs=[said_it])
    if kind == "tool":
        return vf.ToolEnv(dataset=data, tools=[echo], max_turns=max_turns, rubric=rubric)

    class Talk(vf.MultiTurnEnv):
        async def env_response(self, messages: Any, state: Any, **kw: Any) -> Any:
            return [{"role": "user", "content": f"turn {len(state['trajectory'])}: go on"}]

    return Talk(dataset=data, max_turns=max_turns, rubric=rubric)
