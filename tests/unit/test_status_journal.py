"""The status carries the journal's health, and ``phalanx status`` says when the
journal cannot take writes (and where an etcd journal lives)."""

from __future__ import annotations

from pathlib import Path

from phalanx.config import JobConfig
from phalanx.console.view import status_text
from phalanx.controller.core.state import ControllerState
from phalanx.controller.journal import SqliteJournal
from phalanx.controller.payloads import PayloadLog
from phalanx.controller.service import ControllerService
from phalanx.protocol.status import JournalHealth, Status


def test_the_service_reports_a_healthy_sqlite_journal(tmp_path: Path):
    svc = ControllerService(
        JobConfig(), SqliteJournal(tmp_path / "j.sqlite"), PayloadLog(tmp_path / "p")
    )
    j = svc.status().journal
    assert j == JournalHealth(kind="sqlite", where=str(tmp_path / "j.sqlite"), healthy=True)
    assert "journal" not in status_text(svc.status()), "a healthy SQLite journal goes unsaid"
    svc.journal.close()


def with_journal(**fields: object) -> Status:
    st = ControllerState(JobConfig())
    st.start(0.0, 0.0)
    return st.status(0.0).model_copy(update={"journal": JournalHealth.model_validate(fields)})


def test_phalanx_status_names_an_etcd_journal_and_says_when_it_is_unavailable():
    where = "etcd://10.0.0.1:2379,10.0.0.2:2379/phalanx/job"
    ok = with_journal(kind="etcd", where=where, healthy=True, term=3)
    assert f"  journal: {where} (leader term 3)\n" in status_text(ok)
    down = with_journal(
        kind="etcd",
        where=where,
        healthy=False,
        error="etcd at 10.0.0.1:2379 did not answer within 2 s (no quorum, or stopped)",
        unavailable_since=1e9,
        unjournaled=4,
        term=3,
    )
    line = next(x for x in status_text(down).splitlines() if "JOURNAL" in x)
    assert line.startswith("  JOURNAL UNAVAILABLE since ")
    assert line.endswith(
        f": {where}: etcd at 10.0.0.1:2379 did not answer within 2 s (no quorum, or stopped); "
        "4 change(s) held, requests that need a write get 503"
    )
