"""Never lose a committed step (issue 34), with the RL job's real processes and real
SIGKILLs: a controller, policy replicas and a rollout replica.

The audit that found it: each policy replica on its own ``--state`` root, one
killed, the other training alone and checkpointing into its own root, then
killed; the first came back, resumed from its own older checkpoint and went on
from there, and the ledger counted both branches as trained. Now:

- replicas of one role must share one checkpoint root: one with a root of its
  own is refused, in one line;
- with a shared root, the job's step goes back only by an explicit rollback
  (when no replica and no checkpoint holds it any more), which the ledger
  follows: the rollouts it calls trained are exactly those of the final
  model's lineage, read from the policies' step logs;
- the policy replicas end on the same step, and their final files are the
  same bytes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from procs import PROGRESS_S, wait_for, write_job_toml
from test_rl import RLReplica, job_sections, rl_status, wait_finished

from phalanx.protocol.rl import parse_rollout_id

WAIT_S = 2.0
"""``timeouts.lost_step_wait_s``: how long a round behind the job's step waits."""


@pytest.fixture
def make(tmp_path: Path, procs):
    """``make(**job_sections)`` -> (controller, start), with a short lost-step wait."""
    from procs import Controller

    def job(**kw: Any):
        sections = job_sections(**kw)
        sections["timeouts"] = {**sections["timeouts"], "lost_step_wait_s": WAIT_S}
        config = write_job_toml(tmp_path / "rl.toml", sections)
        ctl = Controller(procs, tmp_path / "state", config).start()

        def start(role: str, name: str, *extra: str, spare: bool = False) -> RLReplica:
            final = None
            if role == "policy":  # each incarnation its own final file
                final = tmp_path / f"{name}.{len(finals)}.safetensors"
                extra = ("--out", str(final), *extra)
            r = RLReplica(procs, ctl, config, role, name, *extra, spare=spare)
            finals[id(r)] = final
            return r

        return ctl, start

    return job


finals: dict[int, Path | None] = {}
"""Each policy replica's final file (by ``id`` of its :class:`RLReplica`)."""


def lineage(ctl: Any, policies: list[RLReplica]) -> dict[int, list[str]]:
    """The final model's lineage from the policies' step logs: batch -> its rollouts.

    Replays every commit and every rollback in time order: the job's step never goes
    below one it committed but at a rollback, and then to the rollback's step. A
    commit is in the lineage unless a later rollback went below its step."""
    rollbacks = sorted(ctl.status()["roles"]["policy"]["rollbacks"], key=lambda r: r["at"])
    commits = sorted(
        (e for p in policies for e in p.events("step")), key=lambda e: (e["t"], e["step"])
    )
    job, todo = 0, list(rollbacks)
    for e in commits:
        while todo and todo[0]["at"] < e["t"]:
            rb = todo.pop(0)
            assert rb["to_step"] < rb["from_step"], rb
            job = rb["to_step"]
        assert e["step"] >= job, f"step {e['step']} committed below the job's {job}: {e}"
        job = max(job, e["step"])
    out: dict[int, list[str]] = {}
    for e in commits:
        if not e["rollouts"] or any(
            rb["at"] > e["t"] and rb["to_step"] < e["step"] for rb in rollbacks
        ):
            continue
        assert out.setdefault(e["batch"], e["rollouts"]) == e["rollouts"], e
    return out


def check_lineage(ctl: Any, policies: list[RLReplica]) -> dict[str, Any]:
    """ "Trained" in the ledger is "in the final model's lineage", and balanced."""
    st = rl_status(ctl)
    batches = lineage(ctl, policies)
    prompts = [parse_rollout_id(rid)[0] for b in sorted(batches) for rid in batches[b]]
    assert st["ok"], f"the ledger does not balance: {st}"
    assert len(prompts) == len(set(prompts)), "a prompt is twice in the lineage"
    assert st["rollouts"]["trained"] == st["prompts"]["trained"] == len(prompts), (
        st["rollouts"],
        len(prompts),
    )
    assert sorted(batches) == list(range(len(batches))), "a batch is missing from the lineage"
    return st


def check_final_files(policies: list[RLReplica]) -> None:
    """Every policy replica that finished the job wrote the same bytes, at its last
    step; one that found it finished while behind wrote none."""
    done = [(p, e) for p in policies for e in p.events("done")]
    wrote = [(p, e) for p, e in done if not e.get("finished_elsewhere")]
    assert wrote, done
    assert len({e["step"] for _, e in wrote}) == 1, [e for _, e in done]
    blobs = {finals[id(p)].read_bytes() for p, _ in wrote}  # type: ignore[union-attr]
    assert len(blobs) == 1, f"{len(blobs)} different final files"


def test_a_replica_whose_root_is_its_own_is_refused_in_one_line(make, tmp_path):
    _, start = make(steps=40, target_reward=0.99)
    p0 = start("policy", "policy-0", "--state", str(tmp_path / "disk-a" / "ckpt"))
    wait_for(lambda: p0.events("start"), PROGRESS_S, "policy-0 to start")
    p1 = start("policy", "policy-1", "--state", str(tmp_path / "disk-b" / "ckpt"))
    assert p1.proc.wait(PROGRESS_S) == 78  # a restart cannot help
    err = p1.err.read_text().strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert (
        f"policy replicas must share one state root: got {tmp_path / 'disk-b' / 'ckpt'} on "
        f"policy-1 and {tmp_path / 'disk-a' / 'ckpt'} on policy-0"
    ) in err
    # A root that cannot be written: one line too.
    (tmp_path / "a-file").write_text("")
    p2 = start("policy", "policy-2", "--state", str(tmp_path / "a-file" / "ckpt"))
    assert p2.proc.wait(PROGRESS_S) == 78
    err = p2.err.read_text().strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"--state {tmp_path / 'a-file' / 'ckpt'} must be a checkpoint root" in err
    p0.kill()


def test_the_audits_kills_on_a_shared_root_lose_no_committed_step(make):
    """Finding 1 of the audit, on a shared root: policy-0 killed, policy-1 trains alone
    and checkpoints, policy-1 killed, policy-0 back, then policy-1 back."""
    ctl, start = make(policy_init=2, steps=24, target_reward=0.99)
    p0, p1 = start("policy", "policy-0"), start("policy", "policy-1")
    roll = start("rollout", "rollout-0")
    p0b = start("policy", "policy-0", spare=True)
    p1b = start("policy", "policy-1", spare=True)
    wait_for(lambda: rl_status(ctl)["policy_step"] >= 4 and p0.alive(), PROGRESS_S, "step 4")
    p0.kill()
    at = max(e["step"] for e in p1.events("step"))
    wait_for(
        lambda: any(e["participants"] == 1 and e["step"] >= at + 6 for e in p1.events("step")),
        PROGRESS_S,
        "policy-1 to train alone",
    )
    p1.kill()
    p0b.release()
    wait_for(lambda: p0b.events("step") or not p0b.alive(), PROGRESS_S, "policy-0 to train")
    p1b.release()
    wait_finished(ctl, [p0b, p1b, roll], timeout=PROGRESS_S)
    policies = [p0, p1, p0b, p1b]
    st = check_lineage(ctl, policies)
    # Both came back on the shared root: each resumed from the newest save there.
    for p in (p0b, p1b):
        assert "resumed from" in p.err.read_text() or p.events("step")[0]["healed"]
    rollbacks = ctl.status()["roles"]["policy"]["rollbacks"]
    # policy-1's steps after its last save were gone with it: an explicit rollback to
    # that save, or none (its last commit was saved), never further back.
    saved = p0b.events("step")[0]["step"] - 1
    assert all(rb["to_step"] == saved for rb in rollbacks), (rollbacks, saved)
    assert st["rollouts"]["discarded"].get("rolled_back", 0) == 0  # nothing durable lost
    check_final_files([p0b, p1b])


def test_a_rollback_forced_for_real_is_explicit_and_the_ledger_follows(make, procs):
    """Both policy replicas and their only checkpoint root destroyed: the job's step
    can only go back. The controller waits for a replica that holds it, then rolls
    back on the record; the prompts of the batches lost are issued again."""
    ctl, start = make(policy_init=2, steps=16, target_reward=0.99)
    p0, p1 = start("policy", "policy-0"), start("policy", "policy-1")
    roll = start("rollout", "rollout-0")
    p0b = start("policy", "policy-0", spare=True)
    p1b = start("policy", "policy-1", spare=True)
    wait_for(lambda: rl_status(ctl)["policy_step"] >= 6 and p0.alive(), PROGRESS_S, "step 6")
    p0.kill()
    p1.kill()
    trained = rl_status(ctl)["prompts"]["trained"]
    shutil.rmtree(procs.workdir / "policy-state")
    p0b.release()
    p1b.release()
    wait_finished(ctl, [p0b, p1b, roll], timeout=PROGRESS_S)
    st = check_lineage(ctl, [p0, p1, p0b, p1b])
    (rb,) = ctl.status()["roles"]["policy"]["rollbacks"]
    assert rb["to_step"] == 0 and rb["from_step"] >= 6
    events = [e for e in ctl.status()["events"] if e["kind"] == "rollback"]
    assert events and events[-1]["prompts"] >= trained > 0
    assert st["rollouts"]["discarded"]["rolled_back"] == events[-1]["prompts"]
    timeline = [t["text"] for t in ctl.status()["overview"]["timeline"]]
    assert any(t.startswith(f"rolled back from step {rb['from_step']} to step 0") for t in timeline)
    check_final_files([p0b, p1b])


def test_the_calm_job_ends_every_policy_replica_on_the_same_step(make):
    """Two policy replicas, nobody killed, the job ended by its reward target: one
    used to leave at step N while the other trained step N+1 alone."""
    ctl, start = make(policy_init=2)
    policies = [start("policy", "policy-0"), start("policy", "policy-1")]
    roll = start("rollout", "rollout-0")
    st = wait_finished(ctl, [*policies, roll], timeout=PROGRESS_S)
    assert st["final_step"] == max(e["step"] for p in policies for e in p.events("step"))
    check_lineage(ctl, policies)
    check_final_files(policies)
