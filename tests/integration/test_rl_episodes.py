"""Episodes that outlive their rollout replica, against a real controller process:
replica ``a`` reports a multi-turn episode's progress over HTTP
(``ControllerClient.report_episodes``), the controller is SIGKILLed and restarted
on its state dir (the progress read back from its payload log), ``a`` leaves, and
replica ``b``'s lease carries the progress as ``PromptRef.resume``; ``b``'s rollout
is accepted once, and the counts reach the status and ``/metrics``. Bad reports get
the protocol's one-line 4xx."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from procs import FAST_TIMEOUTS, Controller, write_job_toml

from phalanx.client import ControllerClient
from phalanx.protocol.episode import MAX_TURNS, EpisodeProgress, EpisodeSoFar, Turn
from phalanx.protocol.rl import Completion, RolloutIn

G = 2


def job_toml(path: Path) -> Path:
    return write_job_toml(
        path,
        {
            "job": {"id": "episodes-itest"},
            # Nobody is evicted for a slow heartbeat on a loaded machine meanwhile.
            "timeouts": {**FAST_TIMEOUTS, "heartbeat_s": 10.0, "quorum_s": 20.0},
            "controller": {"tick_s": 0.02},
            "roles.policy": {"min_replicas": 1, "n_init_replicas": 1},
            "roles.rollout": {"min_replicas": 1, "n_init_replicas": 1},
            "rl.grpo": {"steps": 4, "prompts_per_step": 2, "group_size": G, "inner_epochs": 1},
            "rl.loop": {"lease_s": 60.0, "sync_every": 1, "max_staleness": 2},
        },
    )


def progress(rid: str, turns: int) -> EpisodeProgress:
    return EpisodeProgress(
        rollout_id=rid,
        episodes=[
            EpisodeSoFar(
                sample=s,
                prompt_ids=[1, 2, 3],
                turns=[
                    Turn(
                        env_ids=[9, 9] if t else [],
                        token_ids=[4, 5, 6],
                        logprobs=[-0.25, -1.5, -0.125 * (t + 1)],
                        versions=[0, 0, 0],
                        finished=t == turns - 1,
                    )
                    for t in range(turns)
                ],
                env_state=json.dumps({"files": {"a.py": f"step {turns}"}}),
            )
            for s in range(G)
        ],
    )


def test_an_episode_outlives_its_replica_and_a_controller_restart(tmp_path: Path, procs):
    ctl = Controller(procs, tmp_path / "state", job_toml(tmp_path / "job.toml")).start()
    a = ControllerClient(str(ctl.state_dir), "rollout", "a")
    b = ControllerClient(str(ctl.state_dir), "rollout", "b")
    for c in (a, b):
        c.start_heartbeat()
    first = a.lease_prompts(0, 2, wait_s=0).lease
    assert first is not None and [p.rollout_id for p in first.prompts] == ["p0.0", "p1.0"]
    assert all(p.resume is None for p in first.prompts)
    kept = progress("p0.0", turns=3)
    assert a.report_episodes(first.lease_id, [progress("p0.0", turns=1)]).kept == ["p0.0"]
    assert a.report_episodes(first.lease_id, [kept]).kept == ["p0.0"]
    refused = b.report_episodes(first.lease_id, [progress("p1.0", turns=1)])
    assert (refused.kept, refused.unleased) == ([], ["p1.0"])  # a's lease, not b's

    # Bad reports: the protocol's one-line 4xx, naming what was wrong; nothing kept.
    turn = {"token_ids": [1, 2], "logprobs": [-0.5, -0.5], "versions": [0, 0], "finished": True}
    ep = {"sample": 0, "prompt_ids": [1], "turns": [turn]}
    mismatched = {**ep, "turns": [{**turn, "logprobs": [-0.5]}]}
    for episode, code, says in (
        (mismatched, 422, "one log-prob and one version per token"),
        ({**ep, "turns": [turn] * (MAX_TURNS + 1)}, 422, "at most 1024 items"),
        ({**ep, "env_state": "x" * (1 << 20)}, 413, "must be at most"),  # controller.max_body_bytes
        ({**ep, "sample": G}, 400, "outside the group"),
    ):
        body = {
            "replica_id": a.replica_id,
            "lease_id": first.lease_id,
            "progress": [{"rollout_id": "p1.0", "episodes": [episode]}],
        }
        r = ctl.post("/v1/rl/episodes", body)
        err = r.json()
        said = [err["error"]] + [f"{f['field']}: {f['message']}" for f in err["fields"]]
        assert r.status_code == code and any(says in x for x in said), (r.status_code, err)
        assert not any("\n" in x for x in said), err
    st = ctl.status()["rl"]
    assert (st["episodes"]["held"], st["episodes"]["reports"]) == (1, 2)

    # The controller dies and comes back on its state dir: the progress is read back.
    ctl.kill(signal.SIGKILL)
    ctl.start()
    assert ctl.status()["rl"]["episodes"]["held"] == 1
    a.deregister("gone")  # a's lease goes back at once
    again = b.lease_prompts(0, 2, wait_s=10).lease
    assert again is not None
    resume = {p.rollout_id: p.resume for p in again.prompts}
    assert resume == {"p0.0": kept, "p1.0": None}

    comp = Completion(
        prompt_ids=[1, 2, 3], token_ids=[4, 5, 6], logprobs=[-0.25, -1.5, -0.5], finished=True,
        reward=1.0,
    )  # fmt: skip
    roll = RolloutIn(
        rollout_id="p0.0", version=0, reward=1.0, exact_match=1.0, completions=[comp] * G
    )
    assert b.submit_rollouts(again.lease_id, [roll]).accepted == ["p0.0"]
    assert b.submit_rollouts(again.lease_id, [roll]).duplicate == ["p0.0"]  # once
    assert b.report_episodes(again.lease_id, [kept]).unleased == ["p0.0"]  # done

    eps = ctl.status()["rl"]["episodes"]
    assert eps == {
        "held": 0, "held_bytes": 0, "reports": 2, "unleased": 2, "over_cap": 0, "resumed": 1,
        "turns_carried": 3 * G,
    }  # fmt: skip
    metrics = ctl.get("/metrics").text
    assert "phalanx_ledger_episodes_resumed 1.0" in metrics
    assert f"phalanx_ledger_episode_turns_carried {float(3 * G)}" in metrics
    b.close("done")
