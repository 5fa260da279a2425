"""Weight syncs that land during a generation, with real processes: a rollout
replica paced at each chunk boundary (``rl.loop.chunk_delay_s``) is almost always
generating, so the controller's sync orders reach it in flight; its rollouts then
span two versions, and its log lines say so. A replica SIGKILLed while a sync that
names it is in flight leaves the others with whole weights and the ledger balanced.

The job runs a fixed number of steps (its reward target is out of reach), with
24-token completions sampled in chunks of 4 tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import PROGRESS_S, Controller, Procs, wait_for, write_job_toml
from test_rl import RLReplica, check_ledger, job_sections, rl_status, wait_finished

STEPS = 8


@pytest.fixture
def inflight_job(tmp_path: Path, procs: Procs) -> Iterator[Callable[..., tuple[Controller, Any]]]:
    def make(
        rollout_init: int, weights: str = "collective"
    ) -> tuple[Controller, Callable[..., RLReplica]]:
        sections = job_sections(rollout_init=rollout_init, steps=STEPS, target_reward=1e9)
        sections["rl.grpo"]["max_new_tokens"] = 24
        # A rollout submitted a few versions late still trains: this test is about
        # versions within a rollout, not about discards.
        sections["rl.loop"].update(max_staleness=6, lease_s=6.0, sync_timeout_s=4.0)
        sections["rl.engine"] = {"chunk": 4}
        if weights == "storage":  # a pull: the same in-flight path, no rendezvous
            sections["rl.transport"] = {"weights": f"file://{tmp_path}/weights"}
        config = write_job_toml(tmp_path / "rl.toml", sections)
        ctl = Controller(procs, tmp_path / "state", config).start()

        def start(role: str, name: str, *extra: str) -> RLReplica:
            return RLReplica(procs, ctl, config, role, name, *extra)

        return ctl, start

    yield make


def synced_versions(r: RLReplica) -> set[int]:
    """The versions a replica held: the init weights and every sync it completed."""
    return {0} | {e["version"] for e in r.events("sync") if e["ok"]}


# The storage channel's case is slow (the collective's covers the default run): both
# take the same in-flight path, a pull between chunks.
@pytest.mark.parametrize("weights", ["collective", pytest.param("storage", marks=pytest.mark.slow)])
def test_a_sync_lands_during_a_long_generation(inflight_job, weights):
    ctl, start = inflight_job(rollout_init=1, weights=weights)
    policy = start("policy", "policy-0")
    # 0.2 s at each of the 5 chunk boundaries of a lease: about 1 s of generating per
    # lease, so the syncs the policy's commits order find it generating.
    slow = start("rollout", "rollout-0", "--rl.loop.chunk_delay_s", "0.2")
    st = wait_finished(ctl, [policy, slow])
    check_ledger(ctl, st, [policy])

    inflight = [e for e in slow.events("sync") if e["inflight"]]
    assert inflight, f"no sync landed during a generation: {slow.events('sync')}"
    assert all(e["ok"] and e["sync_effect_s"] >= 0 for e in inflight), inflight
    spans = [e for e in slow.events("rollout") if e["inflight_syncs"]]
    assert spans, "no rollout log line reports an in-flight sync"
    assert any(len(e["versions"]) >= 2 for e in spans), spans
    held = synced_versions(slow)
    for e in slow.events("rollout"):
        # Every token came from a whole version this replica loaded.
        assert set(e["versions"]) <= held, (e["versions"], held)
        assert e["versions"] == sorted(e["versions"])


def test_a_rollout_killed_during_an_inflight_sync_leaves_whole_weights(inflight_job):
    ctl, start = inflight_job(rollout_init=2)
    policy = start("policy", "policy-0")
    keep = start("rollout", "rollout-0", "--rl.loop.chunk_delay_s", "0.2")
    doomed = start("rollout", "rollout-doomed", "--rl.loop.chunk_delay_s", "0.2")

    def doomed_named_while_generating() -> bool:
        doomed.alive()
        st = rl_status(ctl)
        sync = st["weights"]["sync_in_flight"]
        rid = next((r for r in st["leased_by"] if r.startswith("rollout-doomed:")), None)
        return bool(rid and sync and rid in sync["members"] and rid not in sync["done"])

    wait_for(doomed_named_while_generating, PROGRESS_S, "a sync in flight to name a busy replica")
    doomed.kill()
    st = wait_finished(ctl, [policy, keep])
    check_ledger(ctl, st, [policy])
    assert st["policy_step"] >= STEPS
    held = synced_versions(keep)
    rolls = keep.events("rollout")
    assert rolls and all(set(e["versions"]) <= held for e in rolls), (rolls, held)
    versions = [e["version"] for e in rolls]
    assert versions == sorted(versions), "the surviving replica's weights went backwards"
