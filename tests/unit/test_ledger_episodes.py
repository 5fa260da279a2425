"""Episodes that outlive their rollout replica, on the controller's side: the progress a
lease's holder reports (``POST /v1/rl/episodes``) is kept while the lease holds its
prompt, carried as ``PromptRef.resume`` when the prompt is dispatched again (lease
expired, holder evicted or gone), kept across a controller restart, and dropped once
the prompt's rollout is in or the job is finished.

Driven through the checked state machine of ``test_ledger`` (journaled and checked
after every call), with the episode book's own invariants checked after each report
and lease here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from test_ledger import (
    LEASE_S,
    R1,
    R2,
    CheckedState,
    G,
    P,
    check,
    ids,
    job,
    lease,
    restart,
    submit,
    train,
)

from phalanx.controller.core.state import StateError
from phalanx.controller.journal import SqliteJournal as Journal
from phalanx.protocol.episode import (
    EpisodeProgress,
    EpisodeProgressReq,
    EpisodeSoFar,
    Turn,
)


@pytest.fixture
def st() -> CheckedState:
    return job()


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    j = Journal(tmp_path / "j.sqlite")
    yield j
    j.close()


def progress(
    rid: str, turns: int = 2, samples: tuple[int, ...] = tuple(range(G))
) -> EpisodeProgress:
    """The episodes of prompt attempt ``rid`` after ``turns`` completed turns each."""
    return EpisodeProgress(
        rollout_id=rid,
        episodes=[
            EpisodeSoFar(
                sample=s,
                prompt_ids=[1, 2],
                turns=[
                    Turn(
                        env_ids=[7, 8] if t else [],
                        token_ids=[3, 4 + t],
                        logprobs=[-0.1, -0.2 * (s + 1)],
                        versions=[0, 0],
                        finished=True,
                    )
                    for t in range(turns)
                ],
                env_state=json.dumps({"turn": turns, "sample": s}),
            )
            for s in samples
        ],
    )


def check_episodes(st: CheckedState) -> None:
    """Progress is kept only for prompts in flight under the attempt it was reported
    for, its bytes add up, and the payload log holds exactly the reports kept."""
    led = st.ledger
    assert led is not None
    book = led.episodes
    for idx, rec in book.kept.items():
        p = led.prompts.by_index[idx]
        assert p.state in ("queued", "leased") and p.rollout_id == rec["rollout_id"], (idx, rec)
    assert book.bytes == sum(rec["bytes"] for rec in book.kept.values())
    held = {k for k in st.payloads if k.startswith("ep/")}
    assert held == book.keys()


def report(
    st: CheckedState, rid: str, lease_id: str, *reports: EpisodeProgress, now: float = 0.0
) -> dict[str, Any]:
    reply, _ = st._rl("report_episodes", rid, lease_id, list(reports), now=now, wall=now)
    check_episodes(st)
    out: dict[str, Any] = reply.model_dump(mode="json", exclude={"epoch", "job_id"})
    return out


def leased(st: CheckedState, rid: str, n: int, *, now: float = 0.0) -> dict[str, Any]:
    reply = lease(st, rid, n, now=now)
    check_episodes(st)
    return reply


def resumes(reply: dict[str, Any]) -> dict[str, Any]:
    return {p["rollout_id"]: p["resume"] for p in reply["lease"]["prompts"]}


def test_progress_is_carried_to_the_next_holder_and_gone_once_the_rollout_is_in(st):
    first = leased(st, R1, 2)
    assert ids(first) == ["p0.0", "p1.0"] and resumes(first) == {"p0.0": None, "p1.0": None}
    assert report(st, R1, "L1", progress("p0.0", turns=1)) == {
        "kept": ["p0.0"], "unleased": [], "over_cap": [],
    }  # fmt: skip
    last = progress("p0.0", turns=3)
    assert report(st, R1, "L1", last)["kept"] == ["p0.0"]  # replaces the first report
    assert len(st.ledger.episodes.kept) == 1 and st.ledger.counts["episode_reports"] == 2

    st.tick(now=LEASE_S, wall=LEASE_S)  # R1's lease expires unsubmitted
    again = leased(st, R2, 2, now=LEASE_S)
    assert ids(again) == ["p0.0", "p1.0"]  # the same attempts
    assert resumes(again) == {"p0.0": last.model_dump(mode="json"), "p1.0": None}
    ev = st.events[-1]
    assert (ev["kind"], ev["rollout_id"], ev["replica_id"], ev["lease_id"]) == (
        "episode_resumed", "p0.0", R2, "L2",
    )  # fmt: skip
    assert (ev["episodes"], ev["turns"]) == (G, 3 * G)
    status = st.ledger.status().episodes
    assert status is not None
    assert (status.held, status.reports, status.resumed, status.turns_carried) == (1, 2, 1, 3 * G)

    # The old holder's reports are refused now: the episode is R2's.
    assert report(st, R1, "L1", progress("p0.0", turns=4))["unleased"] == ["p0.0"]
    assert report(st, R2, "L2", progress("p0.0", turns=4))["kept"] == ["p0.0"]
    assert submit(st, R2, "L2", ["p0.0"])["accepted"] == ["p0.0"]
    check_episodes(st)
    assert st.ledger.episodes.kept == {} and st.ledger.episodes.bytes == 0
    assert not st.tables.get("episodes")  # its journal row went with it
    assert submit(st, R1, "L1", ["p0.0"])["duplicate"] == ["p0.0"]  # accounted for once
    assert report(st, R2, "L2", progress("p0.0"))["unleased"] == ["p0.0"]  # done: refused

    # Forced out again (its payload lost): the next attempt starts afresh.
    out, _ = st.lost_payloads(P, [("p0.0", "payload_missing")], now=LEASE_S, wall=LEASE_S)
    assert out["discarded"] == ["p0.0"]
    assert report(st, R2, "L2", progress("p1.0"))["kept"] == ["p1.0"]
    st.deregister(R2, "gone", now=LEASE_S, wall=LEASE_S)  # its lease goes back at once
    third = leased(st, R1, 4, now=LEASE_S)
    assert resumes(third)["p0.1"] is None
    assert resumes(third)["p1.0"] == progress("p1.0").model_dump(mode="json")
    assert st.ledger.counts["episodes_resumed"] == 2


def test_an_evicted_holders_progress_goes_to_the_next_lease():
    st = job("rl.loop.lease_s=30")  # only the eviction returns the prompt
    leased(st, R1, 1)
    assert report(st, R1, "L1", progress("p0.0"))["kept"] == ["p0.0"]
    tick = st.evict_replica(R1, "test", now=1, wall=1)
    st.commit(tick)
    check(st)
    assert resumes(leased(st, R2, 1, now=1)) == {"p0.0": progress("p0.0").model_dump(mode="json")}


def test_reports_outside_the_callers_live_lease_are_refused_as_unleased(st):
    leased(st, R1, 2)
    leased(st, R2, 1)
    before = st.ledger.counts["episode_reports"]
    refused = {"kept": [], "over_cap": []}
    assert report(st, R2, "L1", progress("p0.0")) == {**refused, "unleased": ["p0.0"]}  # R1's
    assert report(st, R2, "L2", progress("p0.0")) == {**refused, "unleased": ["p0.0"]}  # not in L2
    assert report(st, R1, "L9", progress("p0.0")) == {**refused, "unleased": ["p0.0"]}  # made up
    assert report(st, R1, "L1", progress("p7.0")) == {**refused, "unleased": ["p7.0"]}  # not issued
    assert report(st, R1, "L1", progress("p0.1")) == {**refused, "unleased": ["p0.1"]}  # attempt
    # One report of a request may be kept and the other refused.
    out = report(st, R2, "L2", progress("p2.0"), progress("p0.0"), now=1)
    assert (out["kept"], out["unleased"]) == (["p2.0"], ["p0.0"])
    # Past its deadline, even before a tick ends the lease.
    assert report(st, R1, "L1", progress("p1.0"), now=LEASE_S)["unleased"] == ["p1.0"]
    st.tick(now=LEASE_S, wall=LEASE_S)
    assert report(st, R1, "L1", progress("p1.0"), now=LEASE_S)["unleased"] == ["p1.0"]
    assert st.ledger.counts["episode_reports"] == before + 1
    assert st.ledger.counts["episode_unleased"] == 8


def test_progress_survives_a_controller_restart(journal):
    st = job(journal=journal)
    leased(st, R1, 2)
    report(st, R1, "L1", progress("p0.0", turns=2), progress("p1.0", turns=1))
    kept = progress("p0.0", turns=5)
    report(st, R1, "L1", kept)
    # The journal holds one small row per prompt, whatever the number of reports.
    assert sorted(st.tables["episodes"]) == ["0", "1"]
    assert all(len(json.dumps(r)) < 200 for r in st.tables["episodes"].values())

    st = restart(st, journal, now=1)
    check_episodes(st)
    assert st.ledger.episodes.kept.keys() == {0, 1}
    st.deregister(R1, "gone", now=1, wall=1)
    out = resumes(leased(st, R2, 2, now=1))
    assert out == {
        "p0.0": kept.model_dump(mode="json"),
        "p1.0": progress("p1.0", turns=1).model_dump(mode="json"),
    }


def test_progress_whose_payload_was_lost_is_forgotten_at_a_restart(journal):
    st = job(journal=journal)
    leased(st, R1, 2)
    report(st, R1, "L1", progress("p0.0"), progress("p1.0"))
    lost = st.ledger.episodes.kept[0]["key"]
    del st.payloads[lost]  # a torn write, a lost file
    st = restart(st, journal, now=1)
    st.reconcile(now=1, wall=1)
    check_episodes(st)
    assert st.ledger.episodes.kept.keys() == {1}
    st.deregister(R1, "gone", now=1, wall=1)
    out = resumes(leased(st, R2, 2, now=1))
    assert out["p0.0"] is None and out["p1.0"] is not None


def test_reports_past_the_cap_are_not_kept_and_the_last_one_kept_stays():
    size = len(progress("p0.0", turns=2).model_dump_json())
    st = job(f"rl.loop.episode_bytes={2 * size + 10}")
    leased(st, R1, 3)
    assert report(st, R1, "L1", progress("p0.0"), progress("p1.0"))["kept"] == ["p0.0", "p1.0"]
    out = report(st, R1, "L1", progress("p2.0"), progress("p0.0", turns=3))
    assert out == {"kept": [], "unleased": [], "over_cap": ["p2.0", "p0.0"]}
    assert report(st, R1, "L1", progress("p0.0", turns=1))["kept"] == ["p0.0"]  # smaller: fits
    assert st.ledger.counts["episode_over_cap"] == 2
    st.tick(now=LEASE_S, wall=LEASE_S)
    out = resumes(leased(st, R2, 3, now=LEASE_S))
    assert out["p0.0"] == progress("p0.0", turns=1).model_dump(mode="json")
    assert out["p2.0"] is None

    none = job("rl.loop.episode_bytes=0")  # keep none
    leased(none, R1, 1)
    assert report(none, R1, "L1", progress("p0.0"))["over_cap"] == ["p0.0"]


def test_progress_is_dropped_when_the_job_finishes():
    st = job("rl.grpo.steps=1")
    leased(st, R2, 1)  # p0.0: still running when the job ends
    report(st, R2, "L1", progress("p0.0"))
    train(st, 0)  # fills the one batch from p1..p4 and acknowledges it
    assert st.ledger.finished
    check_episodes(st)
    assert st.ledger.episodes.kept == {} and not any(k.startswith("ep/") for k in st.payloads)
    assert report(st, R2, "L1", progress("p0.0"))["unleased"] == ["p0.0"]  # its lease lives on


@pytest.mark.parametrize(
    ("samples", "match"),
    [((0, G), "outside the group"), ((1, 1), "reported twice")],
)
def test_reports_the_job_cannot_resume_from_are_refused_whole(st, samples, match):
    leased(st, R1, 2)
    with pytest.raises(StateError, match=match) as e:
        report(st, R1, "L1", progress("p0.0"), progress("p1.0", samples=samples))
    assert e.value.status == 400 and e.value.field == "progress.1.episodes.1.sample"
    assert "\n" not in str(e.value)
    assert st.ledger.episodes.kept == {} and st.ledger.counts["episode_reports"] == 0
    with pytest.raises(StateError, match="rollout_id must look like"):
        report(st, R1, "L1", progress("p00.0"))


def test_the_wire_refuses_turns_of_mismatched_lengths():
    turn = {"token_ids": [1, 2], "logprobs": [-0.1], "versions": [0, 0], "finished": True}
    body = {
        "replica_id": R1,
        "lease_id": "L1",
        "progress": [
            {"rollout_id": "p0.0", "episodes": [{"sample": 0, "prompt_ids": [1], "turns": [turn]}]}
        ],
    }
    with pytest.raises(ValidationError, match="one log-prob and one version per token"):
        EpisodeProgressReq.model_validate(body)


def test_a_kept_report_renews_its_lease(st):
    """An episode longer than lease_s stays with the replica that reports its turns: each
    kept report pushes the lease's deadline to lease_s from then; a lease whose holder
    stops reporting still ends at its deadline."""
    leased(st, R1, 1)
    t = 0.75 * LEASE_S
    assert report(st, R1, "L1", progress("p0.0", turns=1), now=t)["kept"] == ["p0.0"]
    st.tick(now=LEASE_S + 0.1, wall=LEASE_S + 0.1)  # past the first deadline, not the renewed
    assert report(st, R1, "L1", progress("p0.0", turns=2), now=LEASE_S + 0.1)["kept"] == ["p0.0"]
    end = LEASE_S + 0.1 + LEASE_S
    assert "L1" in st.ledger.prompts.leases
    st.tick(now=end, wall=end)  # no report since: the lease ends, the prompt goes back
    assert "L1" not in st.ledger.prompts.leases
    assert report(st, R1, "L1", progress("p0.0", turns=3), now=end)["unleased"] == ["p0.0"]
