"""The local launcher's pure parts: option parsing, following desired counts,
the target scan, and the status summary. No processes."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from phalanx import cli
from phalanx.config import JobConfig
from phalanx.console.poll import StatusPoller
from phalanx.console.summary import rl_line, sync_stats
from phalanx.console.view import status_text
from phalanx.controller.core.state import ControllerState
from phalanx.launch.local import LocalJob, Replica
from phalanx.launch.options import launch_counts, parse_scale
from phalanx.protocol.status import BatchRecord, Status

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def rl_cfg(**roles: dict[str, Any]) -> JobConfig:
    return JobConfig.model_validate(
        {
            "rl": {},
            "roles": {"policy": {}, "rollout": {"n_init_replicas": 2}, **roles},
        }
    )


# -- --replicas ---------------------------------------------------------------


def test_replicas_default_to_n_init():
    assert launch_counts(rl_cfg(), None) == ({"policy": 1, "rollout": 2}, [])
    assert launch_counts(JobConfig(), None) == ({"policy": 1}, [])


def test_replicas_per_role_for_rl():
    assert launch_counts(rl_cfg(), "policy=1,rollout=3") == ({"policy": 1, "rollout": 3}, [])
    # A role left out keeps its n_init_replicas.
    assert launch_counts(rl_cfg(), "rollout=4")[0] == {"policy": 1, "rollout": 4}


def test_replicas_below_n_init_lower_it():
    counts, overrides = launch_counts(rl_cfg(), "rollout=1")
    assert counts == {"policy": 1, "rollout": 1}
    assert overrides == ["--roles.rollout.n_init_replicas=1"]


def test_replicas_as_a_number_for_ft():
    assert launch_counts(JobConfig(), "3") == ({"policy": 3}, [])
    assert launch_counts(JobConfig(), "policy=2") == ({"policy": 2}, [])


@pytest.mark.parametrize(
    ("cfg", "text", "message"),
    [
        (rl_cfg(), "2", "ROLE=N"),
        (rl_cfg(), "rollout=x", "whole number"),
        (rl_cfg(), "rollout=-1", ">= 0"),
        (rl_cfg(), "reward=1", "role must be one of"),
        (rl_cfg(), "rollout=1,rollout=2", "each role once"),
        (rl_cfg(), "rollout=0", "min_replicas"),
        (JobConfig(), "rollout=1", "role must be one of ['policy']"),
        (JobConfig(), "0", "min_replicas"),
    ],
)
def test_bad_replicas_are_refused(cfg, text, message):
    with pytest.raises(ValueError, match="--replicas") as e:
        launch_counts(cfg, text)
    assert message in str(e.value)


def test_run_parses_role_counts_and_json():
    args, extra = cli.build_parser().parse_known_args(
        ["run", "job.toml", "--replicas", "policy=1,rollout=3", "--json", "--rl.grpo.steps", "6"]
    )
    assert (args.replicas, args.json, args.plain) == ("policy=1,rollout=3", True, False)
    assert extra == ["--rl.grpo.steps", "6"]


# -- phalanx scale ------------------------------------------------------------


def test_scale_args():
    assert parse_scale(["rollout=3"]) == {"rollout": 3}
    assert parse_scale(["policy=2", "rollout=0"]) == {"policy": 2, "rollout": 0}
    assert parse_scale(["policy=2,rollout=1"]) == {"policy": 2, "rollout": 1}


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["rollout=x"], "count must be a whole number: got rollout='x'"),
        (["rollout=-2"], "count must be >= 0: got rollout=-2"),
        (["learner=2"], "role must be one of ['policy', 'rollout']: got 'learner'"),
        (["rollout"], "entries must look like ROLE=N"),
        (["=3"], "entries must look like ROLE=N"),
        (["rollout=1", "rollout=2"], "each role once"),
        ([","], "at least one"),
    ],
)
def test_bad_scale_args_are_refused(items, message):
    with pytest.raises(ValueError, match="phalanx scale") as e:
        parse_scale(items)
    assert message in str(e.value)


def test_scale_cli_refuses_bad_input_before_calling_the_controller():
    with pytest.raises(SystemExit, match="whole number"):
        cli.main(["scale", "rollout=x", "--controller", "/nonexistent"])


def test_scale_cli_needs_a_controller(monkeypatch):
    monkeypatch.delenv("PHALANX_CONTROLLER", raising=False)
    with pytest.raises(SystemExit, match="--controller must name the controller"):
        cli.main(["scale", "rollout=2"])


def test_status_and_scale_say_when_the_controller_is_gone(tmp_path: Path, capsys):
    """A state dir whose controller exited: one clear line and exit 1, no traceback."""
    import socket

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "url").write_text(f"http://127.0.0.1:{port}\n")
    (tmp_path / "token").write_text("t\n")
    for argv in (["status"], ["status", "--json"], ["scale", "rollout=2"]):
        assert cli.main([*argv, "--controller", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"phalanx: controller at http://127.0.0.1:{port} is unreachable")
        assert f"Is the job still running (state dir {tmp_path})?" in err
        assert "Traceback" not in err


def test_rollout_replica_needs_an_rl_job(capsys):
    """One line, and the exit code that tells launchers a restart cannot help."""
    code = cli.main(["replica", "--role", "rollout", "--controller", "/nonexistent"])
    err = capsys.readouterr().err
    assert code == 78 and "Rollout replicas need an RL job" in err and len(err.splitlines()) == 1
    code = cli.main(["replica", "--state", "s.safetensors", "--controller", "/nonexistent"])
    assert code == 78 and "--state is only for policy replicas" in capsys.readouterr().err


# -- the launcher's decisions ---------------------------------------------------


class Proc:
    """Stands in for a running Popen: the decisions below only look at poll()/pid."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        return None


def job_with(tmp_path: Path, counts: dict[str, int], status: Status | None) -> LocalJob:
    job = LocalJob(None, rl_cfg(), tmp_path, [], counts)
    started: list[str] = []

    def start(r: Replica) -> None:
        r.proc = Proc(1000 + len(started))  # type: ignore[assignment]
        started.append(r.name)

    job.start_replica = start  # type: ignore[method-assign]
    job.poller = StatusPoller(tmp_path)
    job.poller.latest = status
    job.started_names = started  # type: ignore[attr-defined]
    return job


def desired(**roles: int | None) -> Status:
    """The status of an RL job whose operator asked for these replica counts."""
    st = ControllerState(rl_cfg())
    st.start(0.0, 0.0)
    for role, n in roles.items():
        if n is not None:
            st.set_desired(role, n, now=0.0, wall=0.0)
    return st.status(0.0)


def test_follow_desired_starts_next_free_names(tmp_path: Path):
    job = job_with(tmp_path, {"policy": 1, "rollout": 2}, desired(rollout=3))
    del job.replicas["rollout-0"]  # a free slot below the others is reused first
    job._follow_desired(now=0.0)
    assert job.started_names == ["rollout-0", "rollout-2"]  # type: ignore[attr-defined]
    assert sorted(job.replicas) == ["policy-0", "rollout-0", "rollout-1", "rollout-2"]
    job.replicas["rollout-2"].proc = None
    job._follow_desired(now=0.0)  # a replica down (to be restarted) still counts
    assert len(job.started_names) == 2  # type: ignore[attr-defined]


def test_follow_desired_stops_the_highest_numbered(tmp_path: Path, monkeypatch):
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr("os.killpg", lambda pid, sig: signals.append((pid, sig)))
    job = job_with(tmp_path, {"policy": 1, "rollout": 3}, desired(rollout=1, policy=None))
    for r in job.replicas.values():
        job.start_replica(r)
    job._follow_desired(now=5.0)
    retiring = sorted(r.name for r in job.replicas.values() if r.retiring_since is not None)
    assert retiring == ["rollout-1", "rollout-2"]
    assert [sig for _, sig in signals] == [15, 15]  # SIGTERM, by process group id
    job._follow_desired(now=6.0)  # asked once: no second SIGTERM, no new replica
    assert len(signals) == 2 and len(job.replicas) == 4
    # Past the grace, a replica that is still up gets SIGKILL.
    job._supervise(job.replicas["rollout-2"], now=5.0 + job.stop_grace_s + 1, finished=False)
    assert signals[-1][1] == 9


# -- time to target and the summaries -----------------------------------------


def entry(batch: int, avg: float, at: float) -> BatchRecord:
    return BatchRecord(
        batch=batch,
        step=2 * (batch + 1),
        reward=avg,
        exact_match=avg,
        reward_avg=avg,
        exact_match_avg=avg,
        staleness=0,
        at=at,
    )


def history(*entries: BatchRecord) -> Any:
    """What the poller reads of a status: ``rl.history``."""
    return SimpleNamespace(rl=SimpleNamespace(history=list(entries)))


def test_target_counts_only_with_a_full_window(tmp_path: Path):
    p = StatusPoller(tmp_path, target=0.9, window=3)
    p._scan(history(entry(0, 1.0, 10.0), entry(1, 0.95, 11.0)))
    assert p.target_hit is None  # lucky first batches: the window is not full yet
    p._scan(history(entry(1, 0.95, 11.0), entry(2, 0.8, 12.0)))
    assert p.target_hit is None
    p._scan(history(entry(3, 0.91, 13.0), entry(4, 0.99, 14.0)))
    assert p.target_hit == entry(3, 0.91, 13.0)
    assert p.best == entry(0, 1.0, 10.0)


def test_a_reward_target_counts_as_the_jobs_own(tmp_path: Path):
    p = StatusPoller(tmp_path, target=1.0, window=2, target_reward=0.6)
    low = entry(0, 0.5, 10.0).model_copy(update={"reward_avg": 0.7})
    p._scan(history(low))
    assert p.target_hit is None  # the window is not full yet
    hit = entry(1, 0.5, 11.0).model_copy(update={"reward_avg": 0.65})
    p._scan(history(low, hit))
    assert (p.target_hit, p.target_metric) == (hit, "reward")
    assert p.best_reward == low


def test_batches_trained_by_one_ack_are_each_scanned(tmp_path: Path):
    """A DiLoCo round's ack trains its batches at one wall time: each is seen."""
    p = StatusPoller(tmp_path, target=0.9, window=2)
    round_ = [entry(0, 0.5, 10.0), entry(1, 0.95, 10.0), entry(2, 0.99, 10.0)]
    p._scan(history(*round_[:1]))
    p._scan(history(*round_))
    assert p.target_hit == round_[1] and p.best == round_[2]
    p._scan(history(*round_))  # seen: nothing changes
    assert p.target_hit == round_[1]


def test_status_text_of_an_rl_job():
    st = ControllerState(rl_cfg())
    st.start(0.0, 0.0)
    st.set_desired("rollout", 3, now=0.0, wall=0.0)
    text = status_text(st.status(0.0))
    assert "job job (controller epoch 1)" in text
    assert "  rollout: 0 replica(s) (desired 3)\n" in text  # no quorums: no step
    assert "  policy: 0 replica(s), step 0, quorum 0\n" in text
    assert "prompts: issued 0 = queued 0 + leased 0 + done 0 + trained 0" in text
    assert "ledger balanced" in text
    assert "checkpoint" not in text
    rid = st.register("policy", "p0", "i0", now=0.0, wall=0.0)[0].replica_id
    st.record_checkpoint(rid, 8, "s3://b/ck/step-000000008", 2_500_000, now=1.0, wall=1.0)
    assert f"checkpoint: step 8 at s3://b/ck/step-000000008 (2.5 MB, by {rid})" in status_text(
        st.status(1.0)
    )


def test_rl_summary_line():
    s = {
        "job": "sort-grpo",
        "target": 0.9,
        "reached": True,
        "target_batch": 41,
        "target_step": 84,
        "seconds_to_target": 63.25,
        "batches": 42,
        "wall_s": 70.0,
        "prompts": 700,
        "trained": 672,
        "discarded": {"stale": 5},
        "kills": 2,
        "heals": 1,
        "syncs": 42,
        "sync_ms_mean": 12.5,
        "ledger_ok": True,
        "error": None,
        "run_dir": "runs/x",
    }
    assert rl_line(None, s) == (  # type: ignore[arg-type]
        "job sort-grpo: exact match 0.9 reached at batch 41 (step 84) in 63.2 s; prompts 700, "
        "rollouts trained 672, discarded 5 (stale: 5); 2 replica(s) killed, 1 heal(s), syncs 42 "
        "(mean 12.5 ms). Logs: runs/x"
    )
    # A rollback is never hidden: the summary says it, with what the ledger took back.
    rb = {"from_step": 62, "to_step": 24, "batches": 19, "prompts": 304}
    assert rl_line(None, {**s, "rollbacks": [rb]}).endswith(  # type: ignore[arg-type]
        "(mean 12.5 ms); rolled back from step 62 to step 24: 19 batches, 304 prompts "
        "issued again. Logs: runs/x"
    )
    # A job that stops on its reward says so, and names both targets when neither came.
    s |= {"target": 1.0, "target_reward": 0.6, "reached_metric": "reward"}
    assert rl_line(None, s).startswith(  # type: ignore[arg-type]
        "job sort-grpo: reward 0.6 reached at batch 41 (step 84) in 63.2 s;"
    )
    s |= {"reached": False, "best_exact_match_avg": 0.25, "best_reward_avg": 0.5}
    assert rl_line(None, s).startswith(  # type: ignore[arg-type]
        "job sort-grpo: exact match 1.0 or reward 0.6 not reached in 42 batches (best trailing "
        "mean exact match 0.250, reward 0.500) after 70.0 s;"
    )


def test_sync_count_takes_the_leaders_syncs_and_the_rollout_relays():
    leader, r0, late = (
        Replica("policy-0"),
        Replica("rollout-0", "rollout"),
        Replica("rollout-1", "rollout"),
    )
    for seq in (1, 2):
        leader.apply({"event": "sync", "replica": "p:1", "seq": seq, "ok": True, "ms": 10.0})
        r0.apply({"event": "sync", "replica": "r0:1", "seq": seq, "ok": True, "source": "p:1"})
    # Sync 3: rollout-0 relays its version to the late one; the leader is not in it.
    r0.apply({"event": "sync", "replica": "r0:1", "seq": 3, "ok": True, "source": "r0:1"})
    late.apply({"event": "sync", "replica": "r1:1", "seq": 3, "ok": True, "source": "r0:1"})
    assert (r0.syncs, r0.relayed, late.relayed) == (3, 1, 0)
    assert sync_stats([leader, r0, late]) == (3, 10.0)


def test_live_view_renders_an_rl_job(tmp_path: Path):
    from rich.console import Console

    from phalanx.console.view import View

    st = ControllerState(rl_cfg())
    st.start(0.0, 0.0)
    job = job_with(tmp_path, {"policy": 1, "rollout": 2}, st.status(0.0))
    for r in job.replicas.values():
        job.start_replica(r)
    job._on_event(job.replicas["rollout-1"], {"event": "rollout", "accepted": 4, "version": 2})
    job._on_event(
        job.replicas["policy-0"],
        {"event": "step", "step": 3, "loss": 0.25, "participants": 1, "quorum_id": 1},
    )
    job.replicas["rollout-0"].proc = None
    console = Console(record=True, width=80)
    console.print(View(job, live=False)._render())
    text = console.export_text()
    assert "policy-0" in text and "step 3 loss 0.250" in text
    assert "4 rollouts" in text and "v2" in text and "down" in text
    assert "prompts: issued 0 = queued 0" in text and "rollout 1 running, 0 registered" in text


def test_a_replica_of_several_ranks_is_started_through_the_ranks_launcher(tmp_path: Path):
    from phalanx.config import load_config
    from phalanx.launch.local import LocalJob

    cfg = load_config(overrides=["replica.ranks=2"])
    job = LocalJob(None, cfg, tmp_path, ["replica.ranks=2"], 1)
    cmd = job.replica_cmd(job.replicas["policy-0"])
    assert cmd[1:6] == ["-m", "phalanx.launch.ranks", "--nproc", "2", "--"]
    assert cmd[6:9] == [sys.executable, "-m", "phalanx.cli"] and "replica" in cmd
    one = LocalJob(None, load_config(), tmp_path, [], 1)
    assert one.replica_cmd(one.replicas["policy-0"])[1:3] == ["-m", "phalanx.cli"]


def test_only_the_policy_replicas_of_an_rl_job_span_several_ranks(tmp_path: Path):
    from phalanx.config import load_config
    from phalanx.launch.local import LocalJob

    over = ["replica.ranks=2"]
    cfg = load_config(EXAMPLES / "sort_grpo.toml", overrides=over)
    job = LocalJob(
        str(EXAMPLES / "sort_grpo.toml"), cfg, tmp_path, over, {"policy": 1, "rollout": 1}
    )
    policy = job.replica_cmd(job.replicas["policy-0"])
    assert policy[1:6] == ["-m", "phalanx.launch.ranks", "--nproc", "2", "--"]
    assert "--state" in policy  # the sharded policy saves its shards there
    rollout = job.replica_cmd(job.replicas["rollout-0"])
    assert rollout[1:3] == ["-m", "phalanx.cli"] and "phalanx.launch.ranks" not in rollout
