"""A controller starts on a journal an older version wrote: the tables of the named
rollout queues it held (removed with the ``/v1/queue`` routes) are deleted, with the
rollouts they kept in the payload log, and everything else restores as before."""

from __future__ import annotations

from pathlib import Path

from phalanx.config import JobConfig
from phalanx.controller.core.base import RETIRED_TABLES
from phalanx.controller.journal import SqliteJournal as Journal
from phalanx.controller.payloads import PayloadLog
from phalanx.controller.service import ControllerService


def old_queue_records(journal: Journal, payloads: PayloadLog) -> None:
    """What a controller that served ``/v1/queue/*`` journaled for a queue ``q`` with one
    rollout queued (leased once) and one acked, and a record torn on disk."""
    rollout = {"rollout_id": "r1", "x": [1, 2]}
    payloads.put([("q/q/r1", rollout)])
    journal.write(
        [
            ("rq_items", "q/r1", {"q": "q", "id": "r1", "seq": 1, "crc": 123}),
            ("rq_leases", "q/r1", {"q": "q", "id": "r1", "attempt": 1, "held": True}),
            ("rq_done", "q/r0", {"q": "q", "id": "r0", "s": "a"}),
            ("rq_meta", "q", {"seq": 2, "counts": {"put": 2, "acked": 1}, "discarded": {}}),
        ]
    )
    journal.db.execute("INSERT INTO records VALUES ('rq_items', 'q/r2', '{torn')")


def test_a_journal_with_the_old_queue_tables_starts_and_drops_them(tmp_path: Path):
    journal, payloads = Journal(tmp_path / "j.sqlite"), PayloadLog(tmp_path / "payloads")
    svc = ControllerService(JobConfig(), journal, payloads)
    rid = svc.apply(svc.state.register, "policy", "a", "i0").replica_id
    old_queue_records(journal, payloads)
    journal.close()

    journal, payloads = Journal(tmp_path / "j.sqlite"), PayloadLog(tmp_path / "payloads")
    svc = ControllerService(JobConfig(), journal, payloads)
    assert svc.epoch == 2 and rid in svc.state.members, "the rest restored as before"
    assert svc.state.status(0.0).job_id == JobConfig().job.id
    tables = journal.load()
    assert not any(tables.get(t) for t in RETIRED_TABLES), "the old tables are gone"
    assert payloads.get("q/q/r1") is None, "the rollouts they kept are dropped"
    journal.close()

    # ... for good: a third start finds nothing of them.
    journal = Journal(tmp_path / "j.sqlite")
    assert not any(journal.load().get(t) for t in RETIRED_TABLES)
    journal.close()
