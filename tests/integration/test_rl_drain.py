"""The operator's drain (the dashboard's action, ``POST /v1/replicas/drain``) on the
real RL job: a controller, two policy and two rollout replicas (``phalanx replica``).
One replica of each role is drained while the job runs. Each must leave by itself
at a safe boundary (the policy after an acknowledged step, the rollout between two
generation batches), exit 0 with a ``done`` line marked ``drained``, and lose
nothing: every prompt it held or submitted is trained, exactly once, by the
replicas that stay, and the ledger balances at the end."""

from __future__ import annotations

from pathlib import Path

from procs import Controller, Procs, wait_for, write_job_toml
from test_rl import RLReplica, check_ledger, job_sections, rl_status, trained_prompts, wait_finished

from phalanx.controller.core.ledger import rollout_prompt

BATCHES = 40
"""Rollout batches the job trains (the reward target is out of reach): enough that the
two replicas left train well past the drain."""


def test_drained_replicas_leave_at_a_boundary_and_lose_nothing(tmp_path: Path, procs: Procs):
    sections = job_sections(policy_init=2, rollout_init=2, steps=BATCHES, target_reward=0.99)
    sections["rl.model"] = {"hidden_size": 32, "num_layers": 1, "num_heads": 2}
    # Paced (0.05 s per prompt) so that the drain lands mid-job on a fast machine too;
    # no stale discards, whose leases stay open until their deadline (lease_s) and
    # would stall a rollout replica that long.
    sections["rl.loop"].update(gen_delay_s=0.05, max_staleness=4)
    config = write_job_toml(tmp_path / "rl.toml", sections)
    ctl = Controller(procs, tmp_path / "state", config).start()

    def start(role: str, name: str) -> RLReplica:
        return RLReplica(procs, ctl, config, role, name)

    p0, p1 = start("policy", "policy-0"), start("policy", "policy-1")
    r0, r1 = start("rollout", "rollout-0"), start("rollout", "rollout-1")
    everyone = [p0, p1, r0, r1]

    def running() -> bool:
        return all(r.alive() for r in everyone)

    wait_for(
        lambda: running() and r1.events("rollout") and rl_status(ctl)["policy_step"] >= 4,
        120,
        "both roles to run a few batches",
        0.1,
    )
    ids = {r.name: r.events("start")[0]["replica"] for r in (p1, r1)}
    at_drain = rl_status(ctl)["policy_step"]
    for rid in ids.values():
        reply = ctl.post("/v1/replicas/drain", {"replica_id": rid})
        assert reply.status_code == 200, reply.text

    # Both leave by themselves, exit 0 and say so; the others go on. (The status lists
    # the latest 100 events: collect them while waiting.)
    seen: dict[int, dict] = {}

    def gone(r: RLReplica) -> bool:
        exited = r.proc.poll() is not None  # it deregistered before exiting
        seen.update({e["seq"]: e for e in ctl.status()["events"]})
        return exited

    for r in (p1, r1):
        wait_for(lambda r=r: gone(r), 30, f"{r.name} to leave", 0.2)
        assert r.proc.returncode == 0, r.err.read_text()[-3000:]
        (done,) = r.events("done")
        assert done["drained"] is True, done
    events = [seen[k] for k in sorted(seen)]
    left = {e["replica_id"]: e for e in events if e["kind"] == "evict"}
    for rid in ids.values():
        assert left[rid]["reason"] == "left: drained" and left[rid]["detector"] == "left"
    st = wait_finished(ctl, [p0, r0])
    assert st["policy_step"] == BATCHES * 2  # inner_epochs = 2: nothing was lost or redone

    # The policy left after an acknowledged step (a batch boundary), and the step after
    # it was trained by policy-0 alone.
    p1_done = p1.events("done")[0]
    assert p1_done["step"] >= at_drain and p1_done["step"] % 2 == 0, p1_done
    after = [e for e in p0.events("step") if e["step"] > p1_done["step"]]
    assert after and all(e["participants"] == 1 for e in after), after[:3]

    # The rollout replica left between two batches: what it submitted was trained, the
    # lease it held when it left went back at once (not at its deadline) and was
    # trained too, and nothing was trained twice.
    check_ledger(ctl, st, [p0, p1])
    prompts = trained_prompts([p0, p1])
    submitted = {rollout_prompt(x)[0] for e in r1.events("rollout") for x in e["rollouts"]}
    released = [
        e for e in events if e["kind"] == "lease_expired" and e["replica_id"] == ids["rollout-1"]
    ]
    r1_done = r1.events("done")[0]
    assert sum(e["prompts"] for e in released) == r1_done["released"], (released, r1_done)
    assert all("gone" in e["reason"] for e in released), released
    held = {i for e in released for i in e["indices"]}
    assert submitted and (submitted | held) <= set(prompts)
