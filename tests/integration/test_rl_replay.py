"""The RL job with half of each batch drawn from a replay memory
(``rl.loop.replay_ratio = 0.5``), in Redis (a real ``redis-server``) or in the
controller (``memory``): real controller, two policy replicas (one SIGKILLed
mid-job) and a rollout replica. The ledger decides each batch's draw once, so
both policy replicas train identical batches; every replayed use is accounted
for apart from the fresh rollouts, and the ledger balances at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
from procs import PROGRESS_S, Controller, Procs, wait_for, write_job_toml
from redis_server import redis_url  # noqa: F401  (a pytest fixture)
from test_rl import RLReplica, check_ledger, job_sections, rl_status, wait_finished

from phalanx.transport.redis_conn import connect

BATCHES = 8
PPS = 8
"""``rl.grpo.prompts_per_step`` of :func:`test_rl.job_sections`."""


def audit(policy: list[RLReplica]) -> dict[int, tuple[list[str], list[str]]]:
    """Per batch, the (fresh, replayed) rollouts it trained, the same for every replica."""
    seen: dict[int, tuple[list[str], list[str]]] = {}
    for p in policy:
        for e in p.events("step"):
            if e["rollouts"]:
                got = (e["rollouts"], e["replayed"])
                assert seen.setdefault(e["batch"], got) == got, (
                    f"two replicas trained different batches {e['batch']}: {seen[e['batch']]}, {got}"
                )
    return seen


# The memory replay's case is slow (Redis, the one the issue names, is in the default
# run; the memory replay's ledger side is covered by tests/unit/test_ledger_replay.py).
@pytest.mark.parametrize("kind", ["redis", pytest.param("memory", marks=pytest.mark.slow)])
def test_rl_job_with_a_replay_trains_the_same_batches_on_every_replica(
    kind: str, tmp_path: Path, procs: Procs, request: pytest.FixtureRequest
):
    url = request.getfixturevalue("redis_url") if kind == "redis" else "memory"
    sections = job_sections(policy_init=2, rollout_init=1, steps=BATCHES, target_reward=0.99)
    sections["job"]["id"] = f"rl-replay-{tmp_path.name}"[:60]
    sections["rl.loop"]["replay_ratio"] = 0.5
    sections["rl.transport"] = {"replay": url}
    config = write_job_toml(tmp_path / "rl.toml", sections)
    ctl = Controller(procs, tmp_path / "state", config).start()
    p0, p1 = (RLReplica(procs, ctl, config, "policy", f"policy-{i}") for i in range(2))
    roll = RLReplica(procs, ctl, config, "rollout", "rollout-0")
    # Both train the first replayed batches side by side, then one is killed.
    wait_for(
        lambda: sum(1 for e in p1.events("step") if e["replayed"]) >= 2 and p1.alive(),
        PROGRESS_S,
        "policy-1 to train two batches with replayed rollouts",
    )
    p1.kill()
    st = wait_finished(ctl, [p0, roll])
    seen = audit([p0, p1])
    assert sorted(seen) == list(range(BATCHES))
    check_ledger(ctl, st, [p0, p1])  # fresh rollouts: each prompt once
    # Half of a batch is replayed (rollouts trained before it) once the server holds
    # any: a batch frozen before the last one's rollouts were written draws from
    # what the server held then (none, for the first ones).
    trained_before: set[str] = set()
    for b in sorted(seen):
        fresh, replayed = seen[b]
        assert len(fresh) + len(replayed) == PPS
        assert set(replayed) <= trained_before and len(set(replayed)) == len(replayed)
        assert len(replayed) in (0, PPS // 2), (b, seen[b])
        trained_before |= set(fresh)
    assert sum(1 for _, r in seen.values() if r) >= 2
    replay = st["replay"]
    assert replay["replayed"] == sum(len(r) for _, r in seen.values())
    assert (replay["batched"], replay["unavailable"], replay["lost"]) == (0, 0, 0)
    if kind == "memory":  # every trained rollout is held (replay_size is larger)
        assert replay["held"] == BATCHES * PPS - replay["replayed"]
        return
    # Every trained rollout reached the Redis replay, under the job's store name.
    r = connect(url)
    (key,) = r.keys(f"phalanx:{sections['job']['id']}.*:replay:ids")
    wait_for(lambda: rl_status(ctl)["replay"]["unwritten"] == 0, PROGRESS_S, "the replay writes")
    assert r.zcard(key) == BATCHES * PPS - replay["replayed"]
