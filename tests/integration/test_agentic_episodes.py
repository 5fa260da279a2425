"""Multi-turn episodes against real ``verifiers`` environments on the real HF and vLLM
engines (:mod:`phalanx.rl.agentic`): token-in/token-out, the environment's tokens
masked, a weight update in the middle of an episode, an episode replayed from the turns
a lost replica reported, and the one-line errors of a bad environment.

The model is a small Qwen2 with the tool-calling tokenizer of ``make_model.py
--agentic``, taught in a few seconds to call the ``echo`` tool and then answer
(``agentic_models.teach``), so that its episodes in a ``ToolEnv`` take two turns."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from agentic_models import load_environment, make_agentic_model, teach

from phalanx.config.rl import RLConfig
from phalanx.protocol.episode import EpisodeProgress
from phalanx.protocol.rl import Completion, PromptRef
from phalanx.rl.agentic.envs import EnvLoadError, load_env
from phalanx.rl.agentic.runner import Episodes
from phalanx.rl.agentic.toolcalls import parse_tool_calls
from phalanx.rl.engine.base import Completion as EngineCompletion
from phalanx.rl.engine.base import GenerationEngine
from phalanx.rl.engine.factory import rollout_engine
from phalanx.rl.grpo import collate
from phalanx.rl.model import build_model
from phalanx.rl.tokenizer import HFTokenizer, load_tokenizer

GROUP = 2


@pytest.fixture(scope="module")
def taught(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("agentic")
    return teach(make_agentic_model(d / "random"), d / "taught")


def rl_config(model: Path, kind: str = "tool", engine: str = "hf", **env: Any) -> RLConfig:
    return RLConfig.model_validate(
        {
            "env": {"module": "agentic_models", "args": {"kind": kind}, **env},
            "task": {"tokenizer_path": str(model)},
            "model": {"path": str(model)},
            "engine": {"kind": engine, "chunk": 4},
            "grpo": {"group_size": GROUP, "max_new_tokens": 48, "temperature": 0.05},
        }
    )


class Recorded(GenerationEngine):
    """A real engine, with every generate call's prompts and completions kept."""

    def __init__(self, inner: GenerationEngine):
        self.inner = inner
        self.calls: list[tuple[list[list[int]], list[EngineCompletion]]] = []
        self.inflight_updates = inner.inflight_updates

    @property  # type: ignore[override]
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, v: int) -> None:
        self.inner.version = v

    def generate(self, prompts: Sequence[Sequence[int]], *a: Any, **kw: Any) -> Any:
        out = self.inner.generate(prompts, *a, **kw)
        self.calls.append(([list(p) for p in prompts], out))
        return out

    def layout(self) -> Any:
        return self.inner.layout()

    def load_weights(self, weights: Any, version: int) -> None:
        self.inner.load_weights(weights, version)


def hf_engine(rl: RLConfig, tok: Any) -> Recorded:
    engine = rollout_engine(rl, tok, build_model(rl.model, tok), torch.device("cpu"), "r0")
    engine.version = 0
    return Recorded(engine)


def turns_of(c: Completion) -> tuple[list[list[int]], list[list[int]]]:
    """The model's runs of tokens (mask 1) and the environment's (mask 0), in order."""
    model: list[list[int]] = []
    env: list[list[int]] = []
    prev = None
    for t, m in zip(c.token_ids, c.mask, strict=True):
        side = model if m else env
        if m != prev:
            side.append([])
        side[-1].append(t)
        prev = m
    return model, env


def check_token_in_token_out(rollout: Any, engine: Recorded, tok: HFTokenizer) -> None:
    """Every model turn of every episode is exactly a completion the engine returned
    for exactly the ids the episode held then; the environment's ids are masked."""
    made = {
        (tuple(p), tuple(c.token_ids))
        for ps, cs in engine.calls
        for p, c in zip(ps, cs, strict=True)
    }
    for c in rollout.completions:
        model, env = turns_of(c)
        assert len(model) == 2 and len(env) == 1  # a tool call, the tool's answer, an answer
        ids = list(c.prompt_ids)
        for i, run in enumerate(model):
            assert (tuple(ids), tuple(run)) in made  # sampled from exactly these ids
            ids += run + (env[i] if i < len(env) else [])
        assert tok.tok.decode(env[0], skip_special_tokens=False) == (
            "\n<|im_start|>tool\necho: hi<|im_end|>\n<|im_start|>assistant\n"
        )
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask, strict=True) if not m)
    batch = collate([to_engine(c) for c in rollout.completions], [1.0] * GROUP, tok.pad_id)
    for row, c in enumerate(rollout.completions):
        p = len(c.prompt_ids)
        trained = batch.completion_mask[row, p - 1 : p - 1 + len(c.token_ids)]
        assert trained.tolist() == [float(m) for m in c.mask]


def to_engine(c: Completion) -> EngineCompletion:
    return EngineCompletion(
        0, c.prompt_ids, c.token_ids, c.logprobs, c.finished, 0, versions=c.versions, mask=c.mask
    )


def test_a_two_turn_tool_episode_on_hf_trains_the_engines_own_tokens(taught: Path):
    rl = rl_config(taught)
    tok = load_tokenizer(taught)
    assert isinstance(tok, HFTokenizer)
    engine = hf_engine(rl, tok)
    reports: list[list[EpisodeProgress]] = []
    eps = Episodes(rl, engine, tok, load_env(rl.env))
    out, stats = eps.rollouts([PromptRef(index=0, rollout_id="p0.0")], report=reports.append)
    (rollout,) = out
    assert rollout.reward == 1.0 and not rollout.discard  # it called echo, then said hi
    assert stats.turns == 2 * GROUP and stats.batches == 2
    check_token_in_token_out(rollout, engine, tok)
    # After each turn, the prompt's episodes so far went to the controller.
    assert len(reports) == stats.turns
    assert [len(e.turns) for e in reports[-1][0].episodes] == [2, 2]


@pytest.fixture(scope="module")
def vllm_setup(taught: Path) -> Iterator[tuple[RLConfig, HFTokenizer, Recorded]]:
    pytest.importorskip("vllm")
    rl = rl_config(taught, engine="vllm")
    tok = load_tokenizer(taught)
    assert isinstance(tok, HFTokenizer)
    engine = rollout_engine(rl, tok, build_model(rl.model, tok), torch.device("cpu"), "v0")
    engine.version = 0
    try:
        yield rl, tok, Recorded(engine)
    finally:
        engine.close()


def test_a_two_turn_tool_episode_on_vllm_trains_the_engines_own_tokens(vllm_setup):
    rl, tok, engine = vllm_setup
    eps = Episodes(rl, engine, tok, load_env(rl.env))
    (rollout,), stats = eps.rollouts([PromptRef(index=1, rollout_id="p1.0")])
    assert rollout.reward == 1.0 and stats.turns == 2 * GROUP
    check_token_in_token_out(rollout, engine, tok)


def test_a_weight_update_during_an_episode_aborts_nothing(taught: Path):
    """A new version lands in the middle of the second turn (the engine's between hook,
    as a sync polled between chunks): no turn is abandoned, and each token carries the
    version it was drawn from."""
    rl = rl_config(taught, kind="talk", max_episode_tokens=400)
    tok = load_tokenizer(taught)
    engine = hf_engine(rl, tok)
    weights = {k: v.clone() for k, v in engine.inner.model.state_dict().items()}  # type: ignore[attr-defined]
    hooks = 0

    def between() -> None:
        nonlocal hooks
        hooks += 1
        if hooks == 3:  # after the first turn's batch, inside the second
            engine.load_weights(weights, 1)

    eps = Episodes(rl, engine, tok, load_env(rl.env))
    (rollout,), stats = eps.rollouts([PromptRef(index=0, rollout_id="p0.0")], between)
    # rollouts() returned (no lease abandoned), and every turn of every episode ran.
    assert not rollout.discard and rollout.version == 0 and stats.turns == 4 * GROUP
    for c in rollout.completions:
        model_versions = [v for v, m in zip(c.versions, c.mask, strict=True) if m]
        assert model_versions[0] == 0 and model_versions[-1] == 1
        assert model_versions == sorted(model_versions)
        assert len(turns_of(c)[0]) == 4  # the talk environment's max_turns: all ran


def test_an_episode_reported_by_a_lost_replica_is_replayed_not_generated_again(taught: Path):
    rl = rl_config(taught, kind="talk", max_episode_tokens=400)
    tok = load_tokenizer(taught)
    first = hf_engine(rl, tok)
    reports: list[list[EpisodeProgress]] = []
    env = load_env(rl.env)
    full, _ = Episodes(rl, first, tok, env).rollouts(
        [PromptRef(index=2, rollout_id="p2.0")], report=reports.append
    )
    # The replica "died" after both episodes completed two turns: what it reported then.
    progress = next(r[0] for r in reports if [len(e.turns) for e in r[0].episodes] == [2, 2])
    second = hf_engine(rl, tok)
    (again,), stats = Episodes(rl, second, tok, env).rollouts(
        [PromptRef(index=2, rollout_id="p2.0", resume=progress)]
    )
    assert stats.resumed == GROUP and stats.replayed == 2 * GROUP
    assert stats.turns == 2 * GROUP  # only the turns not reported were generated
    # Keyed by prompt, sample and turn: the same weights finish it exactly as the
    # first replica would have.
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in full[0].completions]
    assert [c.logprobs for c in again.completions] == [c.logprobs for c in full[0].completions]


def test_tool_calls_that_do_not_parse_go_back_to_the_model_as_the_tools_error():
    parsed = parse_tool_calls(
        'x<tool_call>{"name": "echo", "arguments": {"text": </tool_call>', "c"
    )
    assert parsed.content == "x" and parsed.calls[0].name == "echo"
    env = load_environment("tool")
    import asyncio

    msgs = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c-0",
                    "type": "function",
                    "function": {"name": "echo", "arguments": parsed.calls[0].arguments},
                }
            ],
        }
    ]
    (answer,) = asyncio.run(env.env_response(msgs, {}))
    assert answer["role"] == "tool" and "Expecting value" in answer["content"]


@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("no_such_env_module", {}, r"rl.env.module 'no_such_env_module' does not import: "),
        ("agentic_models:nope", {}, r"has no function 'nope'"),
        (
            "agentic_models",
            {"kind": "broken"},
            r"must return a verifiers Environment .* got a dict",
        ),
        ("agentic_models", {"colour": 1}, r"load_environment\(\*\*rl.env.args\) failed: TypeError"),
    ],
)
def test_an_environment_that_does_not_load_is_one_line(module, args, message, taught: Path):
    rl = rl_config(taught)
    assert rl.env is not None
    rl.env.module, rl.env.args = module, args
    with pytest.raises(EnvLoadError, match=message) as e:
        load_env(rl.env)
    assert "\n" not in str(e.value)


def test_phalanx_run_refuses_an_environment_that_does_not_load_before_starting(
    taught: Path, tmp_path: Path
):
    import sys

    from procs import child_env, run_to_end, write_job_toml

    config = write_job_toml(
        tmp_path / "bad.toml",
        {
            "job": {"id": "bad-env"},
            "roles.policy": {"min_replicas": 1, "n_init_replicas": 1},
            "roles.rollout": {"min_replicas": 1, "n_init_replicas": 1},
            "rl.model": {"path": str(taught)},
            "rl.task": {"tokenizer_path": str(taught)},
            "rl.env": {"module": "agentic_models:nope"},
        },
    )
    p = run_to_end(
        [sys.executable, "-m", "phalanx.cli", "run", str(config), "--plain"],
        300,
        env={**child_env(), "PYTHONPATH": str(Path(__file__).parent)},
        cwd=tmp_path,
    )
    assert p.returncode != 0
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith(
        "phalanx run: rl.env.module 'agentic_models' has no function 'nope'"
    )
    assert not (tmp_path / "runs").exists()  # nothing started
