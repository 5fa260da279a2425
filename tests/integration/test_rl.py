"""The RL job with real processes: a controller, policy replicas and rollout
replicas (``phalanx replica --role ...``), real SIGKILLs, and the ledger's
accounting checked at the end: every prompt issued is trained exactly once or
still on its way, and every rollout accepted is trained or discarded with a
reason.

The job is small (8 prompts x 8 samples per batch) and stops once the
trailing mean reward (over 5 batches) reaches 0.15, from ~0.07 at random
init: 10 to 35 batches, depending on the sampling seed, and rarely more than 80
(hence the 200-batch cap).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ftjob import gated_spare
from procs import (
    FAST_TIMEOUTS,
    PROGRESS_S,
    Controller,
    Procs,
    signal_group,
    wait_for,
    write_job_toml,
)


def job_sections(
    policy_init: int = 1,
    rollout_init: int = 1,
    steps: int = 200,
    target_reward: float = 0.15,
    window: int = 5,
    max_staleness: int = 4,
    max_ahead: int = 2,
) -> dict[str, dict[str, Any]]:
    """The RL test job. Generation runs ``max_ahead`` batches ahead, which needs
    ``max_staleness >= max_ahead x inner_epochs`` (config/rl_loop.py: check_ahead)."""
    return {
        "job": {"id": "rl-itest", "seed": 0},
        "timeouts": {**FAST_TIMEOUTS, "collective_s": 2.0, "heartbeat_s": 4.0},
        "controller": {"tick_s": 0.02},
        "roles.policy": {"min_replicas": 1, "n_init_replicas": policy_init, "join_timeout_s": 0.3},
        "roles.rollout": {
            "min_replicas": 1,
            "n_init_replicas": rollout_init,
            "join_timeout_s": 0.3,
        },
        "rl.grpo": {
            "steps": steps,
            "prompts_per_step": 8,
            "group_size": 8,
            "lr": 3e-3,
            "inner_epochs": 2,
            "threads": 1,
        },
        "rl.loop": {
            "prompts_per_lease": 4,
            "sync_every": 2,
            "max_staleness": max_staleness,
            "max_ahead": max_ahead,
            "lease_s": 20.0,
            "target_exact_match": 1.0,
            "target_reward": target_reward,
            "window": window,
        },
    }


SPARE = (
    "import runpy, sys, torch, torch._dynamo, phalanx.jobs.rl_policy, phalanx.jobs.rl_rollout; "
    "sys.stdin.readline(); "
    "runpy.run_module('phalanx.cli', run_name='__main__', alter_sys=True)"
)
"""A warm spare: pays the imports up front, then waits for a line on stdin and runs
``phalanx.cli`` as ``python -m phalanx.cli ARGS`` would. It touches neither the
network nor the controller before it is released."""


class RLReplica:
    """A ``phalanx replica`` subprocess of the RL job; its stdout is JSON lines."""

    def __init__(
        self,
        procs: Procs,
        ctl: Controller,
        config: Path,
        role: str,
        name: str,
        *extra: str,
        spare: bool = False,
        ranks: int = 1,
        host: Any = None,
        env: dict[str, str] | None = None,
    ):
        """``env``: the whole environment of the process (default: the tests')."""
        self.name, self.role = name, role
        head = ["-c", SPARE] if spare else ["-m", "phalanx.cli"]
        self.gate: Path | None = None
        if ranks > 1:  # the replica's ranks, started and failed together
            if spare:  # (the ranks share the launcher's stdin: a file releases them)
                self.gate = procs.workdir / f"{role}-{name}-{id(self)}.go"
                head = ["-c", gated_spare("phalanx.jobs.rl_policy"), str(self.gate)]
            launcher = ["-m", "phalanx.launch.ranks", "--nproc", str(ranks), "--"]
            head = [*launcher, sys.executable, *head]
        args = [sys.executable, *head, "replica", "--role", role, "--name", name]
        args += ["--controller", str(ctl.state_dir), "--config", str(config)]
        if role == "policy":
            args += ["--state", str(procs.workdir / "policy-state")]
        stdin = subprocess.PIPE if spare and self.gate is None else subprocess.DEVNULL
        self.proc, self.out, self.err = procs.spawn(
            [*args, *extra], f"{role}-{name}", env=env, stdin=stdin, host=host
        )

    def release(self) -> None:
        """Start a warm spare's replica (see :data:`SPARE`)."""
        if self.gate is not None:
            self.gate.touch()
            return
        assert self.proc.stdin is not None, f"{self.role} {self.name} is not a spare"
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.close()

    def lines(self) -> list[dict[str, Any]]:
        complete = self.out.read_text().split("\n")[:-1]
        return [json.loads(x) for x in complete if x.startswith("{")]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.lines() if e["event"] == kind]

    def alive(self) -> bool:
        if self.proc.poll() is not None and self.proc.returncode != 0:
            raise AssertionError(
                f"{self.role} {self.name} exited with {self.proc.returncode}:\n"
                f"{self.err.read_text()[-3000:]}"
            )
        return self.proc.poll() is None

    def kill(self) -> None:
        signal_group(self.proc, signal.SIGKILL)
        self.proc.wait(10)


Start = Callable[..., RLReplica]


@pytest.fixture
def rl_job(tmp_path: Path, procs: Procs) -> Iterator[Callable[..., tuple[Controller, Start]]]:
    def make(**sections: Any) -> tuple[Controller, Start]:
        config = write_job_toml(tmp_path / "rl.toml", job_sections(**sections))
        ctl = Controller(procs, tmp_path / "state", config).start()

        def start(role: str, name: str, *extra: str, spare: bool = False) -> RLReplica:
            return RLReplica(procs, ctl, config, role, name, *extra, spare=spare)

        return ctl, start

    yield make


def rl_status(ctl: Controller) -> dict[str, Any]:
    return ctl.status()["rl"]


def wait_finished(ctl: Controller, replicas: list[RLReplica], timeout: float = 180.0) -> dict:
    def done() -> dict[str, Any] | None:
        for r in replicas:
            r.alive()
        st = rl_status(ctl)
        return st if st["finished"] and not any(r.proc.poll() is None for r in replicas) else None

    return wait_for(done, timeout, "the RL job to finish and its replicas to exit", 0.2)


def trained_prompts(policy: list[RLReplica]) -> list[int]:
    """Prompt indices of every batch the policy trained, once per batch (audit trail)."""
    seen: dict[int, list[str]] = {}
    for p in policy:
        for e in p.events("step"):
            if e["rollouts"]:
                assert seen.setdefault(e["batch"], e["rollouts"]) == e["rollouts"], (
                    "two replicas trained different rollouts for the same batch"
                )
    return [int(rid[1:].split(".")[0]) for b in sorted(seen) for rid in seen[b]]


def check_ledger(ctl: Controller, st: dict[str, Any], policy: list[RLReplica]) -> Any:
    """The product audit (``phalanx audit --state-dir``) of the job, from its
    controller's state dir and ``policy``'s outputs: no check finds a violation, and
    the ledger's checks ran: it balances, as rebuilt from the journal, its trained
    prompts and rollouts are those the policy's lines acknowledged, and no prompt or
    rollout was trained twice. ``st``: the live controller's ledger, which must
    balance too. Returns the audited :class:`phalanx.audit.Run`."""
    from phalanx.audit import audit_checks, load_job

    assert st["ok"], f"ledger does not balance: {st}"
    run = load_job(ctl.state_dir, [p.out for p in policy])
    checks = {c.name: c for c in audit_checks(run)}
    bad = [f"{c.name}: {c.detail}" for c in checks.values() if c.verdict == "FAIL"]
    assert not bad, "the audit found violations:\n" + "\n".join(bad)
    for name in ("steps.once", "steps.order", "ledger.balance", "ledger.trained_once"):
        assert checks[name].verdict == "pass", f"{name} did not run: {checks[name].detail}"
    return run


def test_rl_job_survives_a_rollout_killed_with_a_lease_and_takes_a_joiner(rl_job):
    # A window of 8 batches: the target cannot be met from the batches already
    # generated when the last rollout replica dies at batch 2 (max_ahead 2).
    ctl, start = rl_job(rollout_init=1, window=8)
    policy = start("policy", "policy-0")
    # Paced at 0.25 s per prompt (about 2 s a batch): the job must not reach its
    # target (8 batches at least) while the slow replica's kill is being detected,
    # however fast a quiet machine trains, before this one is killed at batch 2.
    fast = start("rollout", "rollout-0", "--rl.loop.gen_delay_s", "0.25")
    # The slow replica holds each lease for 1.5 s per prompt: long enough to be hit.
    slow = start("rollout", "rollout-slow", "--rl.loop.gen_delay_s", "1.5")

    def slow_holds_a_lease() -> str | None:
        slow.alive()
        held = rl_status(ctl)["leased_by"]
        return next((rid for rid in held if rid.startswith("rollout-slow:")), None)

    slow_id = wait_for(slow_holds_a_lease, PROGRESS_S, "rollout-slow to hold a lease", 0.05)
    slow.kill()
    expired = wait_for(
        lambda: [
            e
            for e in ctl.status()["events"]
            if e["kind"] == "lease_expired" and e["replica_id"] == slow_id
        ],
        15,
        "the killed replica's lease to be dispatched again",
    )
    lost = {i for e in expired for i in e["indices"]}
    assert lost and "gone" in expired[0]["reason"]

    # A joiner after training started must get the current weights before generating.
    # The last rollout replica dies first, so the job cannot reach its target
    # before the joiner has synced and generated (and its lease goes back too).
    assert not rl_status(ctl)["finished"]
    wait_for(lambda: rl_status(ctl)["policy_step"] >= 4, PROGRESS_S, "policy step 4")
    fast.kill()
    joiner = start("rollout", "rollout-late")
    st = wait_finished(ctl, [policy, joiner])

    check_ledger(ctl, st, [policy])
    prompts = trained_prompts([policy])
    # Re-dispatched prompts go first into the next leases; the job may stop at its
    # target before their batch trains, and then the balanced ledger holds them.
    assert lost <= set(prompts) or st["prompts"]["issued"] > st["prompts"]["trained"]
    assert st["last"]["reward_avg"] >= 0.15
    syncs, rolls = joiner.events("sync"), joiner.events("rollout")
    assert syncs, f"the joiner never synced; its rollouts: {rolls}"
    assert syncs[0]["ok"] and syncs[0]["version"] >= 4, syncs[0]
    assert rolls, "the joiner generated nothing"
    assert joiner.lines().index(syncs[0]) < joiner.lines().index(rolls[0])
    for r in (fast, joiner):
        versions = [e["version"] for e in r.events("rollout")]
        assert versions == sorted(versions), f"{r.name}: weights versions went backwards"
    assert all(e["version"] >= syncs[0]["version"] for e in rolls)


def test_rl_stale_rollouts_are_discarded_and_counted(rl_job):
    # At most 4 versions of staleness (two batches: a batch spans two versions, and
    # generation runs max_ahead = 2 batches ahead). A replica that holds each lease
    # 6 s (1.5 s per prompt) while the fast one keeps the policy training submits
    # rollouts whose weights are already too old. The job trains all its 60 batches
    # (a target it cannot meet), so it outlasts the slow replica's leases however
    # fast the machine trains.
    ctl, start = rl_job(rollout_init=1, steps=60, target_reward=0.99)
    policy = start("policy", "policy-0")
    fast = start("rollout", "rollout-0")
    slow = start("rollout", "rollout-slow", "--rl.loop.gen_delay_s", "1.5")
    st = wait_finished(ctl, [policy, fast, slow])
    stale = sum(e["stale"] for e in slow.events("rollout"))
    assert stale > 0 and st["rollouts"]["discarded"].get("stale", 0) >= stale
    check_ledger(ctl, st, [policy])
    assert all(
        v >= b * 2 - 4 for e in policy.events("step") for b in [e["batch"]] for v in e["versions"]
    )
    # The off-policy metrics: every step line has its tokens by staleness (a step
    # trains from version 2b or 2b + 1, its rollouts are from 2b - 4 at the oldest),
    # and the ledger's last batch carries them to the overview and /metrics.
    for e in policy.events("step"):
        assert e["staleness_tokens"] and all(0 <= int(k) <= 5 for k in e["staleness_tokens"])
        assert 0 < e["ess"] <= 1 and e["is_clip_frac"] == e["is_mask_frac"] == 0.0
    last = st["last"]["metrics"]
    assert last["staleness_tokens"] and 0 < last["ess"] <= 1 and last["mismatch_kl"] >= 0
    scraped = ctl.get("/metrics").text
    assert "phalanx_rl_ess " in scraped and "phalanx_rl_mismatch_kl " in scraped
    assert 'phalanx_rl_staleness_tokens{staleness="' in scraped


def test_a_late_rollout_gets_its_weights_from_a_rollout_peer(rl_job):
    """The only policy replica dies after a weight sync: a rollout replica that joins
    then gets the last synced version from its rollout peer (no leader to send it),
    generates with it, and the restarted policy finishes the job."""
    ctl, start = rl_job(rollout_init=1, steps=40, target_reward=0.99)
    policy = start("policy", "policy-0")
    r0 = start("rollout", "rollout-0")
    wait_for(
        lambda: [e for e in r0.events("sync") if e["ok"] and e["version"] >= 2],
        120,
        "a weight sync of version 2 at least",
    )
    policy.kill()
    acked_at_kill = rl_status(ctl)["policy_step"]
    late = start("rollout", "rollout-late")

    def late_synced() -> list[dict[str, Any]]:
        got = [e for e in late.events("sync") if e["ok"]]
        if not got and not late.alive():  # (alive() raises on a failing exit)
            raise AssertionError(
                "the late rollout replica exited 0 without weights:\n"
                f"{late.out.read_text()[-2000:]}\n{late.err.read_text()[-2000:]}\n"
                f"controller: {ctl.status()['overview']['timeline'][-10:]}"
            )
        return got

    syncs = wait_for(late_synced, 300, "the late rollout replica to get weights")
    r0_id = r0.events("start")[0]["replica"]
    assert syncs[0]["source"] == r0_id and syncs[0]["version"] >= 2, syncs[0]
    # r0 says it relayed once its send is done: it may print that after the late
    # replica printed that it received.
    relayed = wait_for(
        lambda: [e for e in r0.events("sync") if e["source"] == r0_id],
        PROGRESS_S,
        "rollout-0 to report the relay",
    )
    assert relayed[0]["ok"] and relayed[0]["seq"] == syncs[0]["seq"], relayed
    timeline = [t["text"] for t in ctl.status()["overview"]["timeline"]]
    assert any(f"relayed by rollout {r0_id} to 1" in t for t in timeline), timeline
    policy_b = start("policy", "policy-0")
    st = wait_finished(ctl, [policy_b, r0, late], timeout=300)
    check_ledger(ctl, st, [policy, policy_b])
    # It resumed from the leader's last checkpoint, never behind an acknowledged step.
    assert policy_b.events("step")[0]["step"] > acked_at_kill
    rolls = late.events("rollout")
    assert rolls and all(e["version"] >= syncs[0]["version"] for e in rolls)


def test_rl_policy_killed_with_two_policy_replicas_rejoins_on_restart(rl_job):
    # A fixed 40 batches (the reward target is out of reach), so that the job is still
    # running when the restarted replica has imported its model and joins.
    ctl, start = rl_job(policy_init=2, rollout_init=1, steps=40, target_reward=0.99)
    p0 = start("policy", "policy-0")
    p1 = start("policy", "policy-1")
    roll = start("rollout", "rollout-0")
    # Its restart is a warm spare: a cold start (the imports) can take longer on a
    # loaded machine than policy-0 needs to finish the job alone.
    p1b = start("policy", "policy-1", spare=True)
    wait_for(lambda: rl_status(ctl)["policy_step"] >= 4 and p1.alive(), PROGRESS_S, "policy step 4")
    p1.kill()
    at_kill = rl_status(ctl)["policy_step"]
    wait_for(
        lambda: any(e["participants"] == 1 and e["step"] > at_kill + 1 for e in p0.events("step")),
        PROGRESS_S,
        "policy-0 to train alone",
    )
    p1b.release()
    wait_for(
        lambda: any(e["participants"] == 2 for e in p1b.events("step")) or not p1b.alive(),
        300,
        "the restarted policy-1 to train beside policy-0",
    )
    st = wait_finished(ctl, [p0, p1b, roll])
    # It rejoins either by healing from policy-0, or, when the leader's checkpoint it
    # resumed from is at the group's step (saves run back to back), as it is.
    first = next(e for e in p1b.events("step") if e["participants"] == 2)
    assert first["healed"] or "resumed from" in p1b.err.read_text(), first
    check_ledger(ctl, st, [p0, p1b])


def test_rl_controller_restart_keeps_ledger_and_step(rl_job):
    ctl, start = rl_job(rollout_init=1)
    policy = start("policy", "policy-0")
    roll = start("rollout", "rollout-0")
    wait_for(lambda: rl_status(ctl)["policy_step"] >= 6, PROGRESS_S, "policy step 6")
    before = rl_status(ctl)
    ctl.kill()
    ctl.start()
    after = rl_status(ctl)
    assert after["policy_step"] >= before["policy_step"]
    assert after["prompts"]["trained"] >= before["prompts"]["trained"]
    assert after["prompts"]["issued"] >= before["prompts"]["issued"] and after["ok"]
    st = wait_finished(ctl, [policy, roll])
    check_ledger(ctl, st, [policy])
    assert ctl.status()["epoch"] == 2
