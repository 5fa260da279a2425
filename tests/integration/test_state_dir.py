"""The controller's state dir and command line as an outside audit tried them (issue 20):
damaged and empty journals, file modes, a token from the environment, a file for a
dir, bad --host and --port, an empty token file, a TOML file that is not UTF-8. Each
gets one line that names the problem and what to do, never a traceback, and nothing
already journaled is lost."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from procs import FAST_TIMEOUTS, Controller, child_env, write_job_toml

from phalanx.console.poll import fetch_status


def job(tmp_path: Path) -> Path:
    # The member these tests register never heartbeats, and must still be there after
    # a restart: a heartbeat timeout longer than any test (a loaded machine once took
    # over 2 s from the register to the status, and it was evicted).
    timeouts = {**FAST_TIMEOUTS, "heartbeat_s": 3600.0, "quorum_s": 7200.0}
    return write_job_toml(tmp_path / "job.toml", {"job": {"id": "sd"}, "timeouts": timeouts})


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A phalanx command that must end by itself (a refusal), with its output."""
    return subprocess.run(
        [sys.executable, "-m", "phalanx.cli", *args],
        capture_output=True,
        text=True,
        env=env or child_env(),
        timeout=120,
    )


def one_line(p: subprocess.CompletedProcess[str], *says: str) -> str:
    """The command failed with exactly one line on stderr, holding each of ``says``."""
    err = p.stderr.strip()
    assert p.returncode != 0, (p.stdout, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for s in says:
        assert s in err, err
    return err


def controller_args(tmp_path: Path, state: Path, *more: str) -> list[str]:
    return ["controller", "--config", str(job(tmp_path)), "--state-dir", str(state), *more]


@pytest.fixture
def used(tmp_path: Path, procs) -> Controller:
    """A state dir a job ran in: a member registered, then the controller SIGKILLed."""
    ctl = Controller(procs, tmp_path / "state", job(tmp_path)).start()
    assert ctl.post("/v1/register", {"role": "policy", "name": "keep-me"}).status_code == 200
    ctl.kill()
    return ctl


def members(ctl: Controller) -> list[str]:
    return [m["name"] for r in ctl.status()["roles"].values() for m in r["replicas"]]


@pytest.mark.parametrize("damage", ["empty", "missing", "truncated", "overwritten", "bit-flipped"])
def test_a_damaged_journal_is_refused_and_fresh_sets_it_aside(used: Controller, damage: str):
    """A 0-byte journal started a fresh job at epoch 1, dropping every member; a damaged
    one gave a 15-line sqlite3 traceback that did not name the file."""
    journal = used.state_dir / "journal.sqlite"
    # Fold the WAL in first, so that the damage below is to the journal itself.
    db = sqlite3.connect(journal)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    for side in ("-wal", "-shm"):
        (used.state_dir / f"journal.sqlite{side}").unlink(missing_ok=True)
    data = journal.read_bytes()
    if damage == "empty":
        journal.write_bytes(b"")
    elif damage == "missing":
        journal.unlink()
    elif damage == "truncated":
        journal.write_bytes(data[: len(data) // 3])
    elif damage == "overwritten":
        journal.write_bytes(b"\x00garbage" * (len(data) // 8))
    else:  # a bit flipped in every page past the header: the records' b-tree is broken
        flipped = bytearray(data)
        for at in range(4096 + 8, len(flipped), 4096):
            flipped[at] ^= 0xFF
        journal.write_bytes(bytes(flipped))
    before = journal.read_bytes() if journal.exists() else None
    p = cli(*controller_args(used.state_dir.parent, used.state_dir, "--port", "0"))
    one_line(p, str(journal), "--fresh")
    # Refused without touching it: the operator can still restore or inspect it.
    assert (journal.read_bytes() if journal.exists() else None) == before
    # --fresh moves the damaged state aside (nothing deleted) and begins at epoch 1.
    fresh = Controller(used.procs, used.state_dir, used.config, args=["--fresh"]).start()
    assert fresh.status()["epoch"] == 1 and members(fresh) == []
    aside = [d for d in used.state_dir.iterdir() if d.name.startswith("set-aside-")]
    assert len(aside) == 1
    if before is not None:
        assert (aside[0] / "journal.sqlite").read_bytes() == before


@pytest.mark.parametrize(
    ("table", "value", "says"),
    [
        ("members", "[1, 2]", "must be a JSON object: got a JSON array"),
        ("members", '{"replica_id": "x"}', "must have a field 'role'"),
        ("meta", '{"value": "1"}', "must have 'value' as a JSON integer: got a JSON string"),
    ],
)
def test_a_journal_record_of_the_wrong_shape_is_one_line(
    used: Controller, table: str, value: str, says: str
):
    """A member row that was a JSON list gave a traceback from deep in the restore."""
    journal = used.state_dir / "journal.sqlite"
    db = sqlite3.connect(journal)
    key = (
        "epoch"
        if table == "meta"
        else db.execute("SELECT key FROM records WHERE tbl = ?", (table,)).fetchone()[0]
    )
    db.execute("UPDATE records SET value = ? WHERE tbl = ? AND key = ?", (value, table, key))
    db.commit()
    db.close()
    p = cli(*controller_args(used.state_dir.parent, used.state_dir, "--port", "0"))
    one_line(p, str(journal), f"record {table}/{key}", says, "--fresh")


def test_a_journal_that_is_whole_is_read_back(used: Controller):
    """The check costs nothing to a healthy restart: same members, next epoch."""
    used.start()
    assert used.status()["epoch"] == 2 and members(used) == ["keep-me"]


def test_state_files_are_the_owners_alone(tmp_path: Path, procs):
    """journal.sqlite and config.json were 0644; the token file was already 0600."""
    old = os.umask(0o022)
    try:
        ctl = Controller(procs, tmp_path / "state", job(tmp_path)).start()
    finally:
        os.umask(old)
    assert ctl.post("/v1/register", {"role": "policy", "name": "a"}).status_code == 200
    files = [p for p in ctl.state_dir.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"journal.sqlite", "journal.sqlite-wal", "config.json", "token", "url"} <= names
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, (p, oct(p.stat().st_mode))
    assert stat.S_IMODE(ctl.state_dir.stat().st_mode) == 0o700


def test_files_an_older_version_left_readable_are_made_private(used: Controller):
    for name in ("journal.sqlite", "config.json"):
        (used.state_dir / name).chmod(0o644)
    used.start()
    for name in ("journal.sqlite", "config.json"):
        assert stat.S_IMODE((used.state_dir / name).stat().st_mode) == 0o600


def test_a_token_from_the_environment_is_written_to_the_token_file(
    tmp_path: Path, procs, monkeypatch
):
    """With $PHALANX_TOKEN set no token file was written, and tools pointed at the state
    dir crashed with FileNotFoundError: .../token."""
    env = {**child_env(), "PHALANX_TOKEN": "from-the-environment"}
    ctl = Controller(procs, tmp_path / "state", job(tmp_path), env=env).start()
    token = ctl.state_dir / "token"
    assert token.read_text().strip() == "from-the-environment"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    monkeypatch.delenv("PHALANX_TOKEN", raising=False)
    assert fetch_status(str(ctl.state_dir)).job_id == "sd"  # a tool with only the dir


def test_an_empty_token_file_is_one_line(tmp_path: Path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "token").write_text("")
    one_line(cli(*controller_args(tmp_path, state)), "token file", "is empty")


def test_a_file_as_state_dir_is_one_line(tmp_path: Path):
    """It said ``[Errno 17] File exists``."""
    f = tmp_path / "a-file"
    f.write_text("x")
    one_line(cli(*controller_args(tmp_path, f)), "--state-dir", "is a file")


@pytest.mark.parametrize("port", ["-1", "70000"])
def test_a_port_out_of_range_is_one_line(tmp_path: Path, port: str):
    one_line(cli(*controller_args(tmp_path, tmp_path / "s", "--port", port)), "0..65535", port)


def test_a_host_that_is_not_this_machines_is_one_line(tmp_path: Path):
    """It said "Pick a free --port"."""
    for host in ("192.0.2.1", "no-such-host.invalid"):
        p = cli(*controller_args(tmp_path, tmp_path / "s", "--host", host))
        err = one_line(p, f"--host {host!r}", "address of this machine")
        assert "--port" not in err


def test_a_port_in_use_is_one_line(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        p = cli(*controller_args(tmp_path, tmp_path / "s", "--port", port))
    one_line(p, f"--port {port}", "in use")


def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path):
    bad = tmp_path / "job.toml"
    bad.write_bytes(b'[job]\nid = "caf\xe9"\n')
    p = cli("controller", "--config", str(bad), "--state-dir", str(tmp_path / "s"))
    one_line(p, str(bad), "not UTF-8", "byte 15")


def test_out_of_bound_numbers_an_older_version_journaled_are_dropped_at_restart(
    used: Controller,
):
    """The audit's ``nbytes = 10**400`` was journaled, and /metrics and /v1/status gave 500
    for good, restarts included. The wire refuses it now; a journal that already holds
    it drops that record at restart, says so in the event log, and serves."""
    rec = {"step": 10**30, "url": "file:///ck", "nbytes": 10**400, "by": "x", "at": 1.0}
    ev = {"seq": 999, "kind": "checkpoint", "at": 1.0, "step": 1, "url": "u", "nbytes": 10**400}
    db = sqlite3.connect(used.state_dir / "journal.sqlite")
    with db:
        db.execute("INSERT INTO records VALUES ('checkpoints', 'big', ?)", (json.dumps(rec),))
        db.execute("INSERT INTO records VALUES ('events', '000000000999', ?)", (json.dumps(ev),))
    db.close()
    used.start()
    assert used.get("/metrics").status_code == 200
    st = used.status()
    assert st["checkpoints"]["latest"] is None and members(used) == ["keep-me"]
    dropped = [e for e in st["events"] if e["kind"] == "journal_record_dropped"]
    assert {(e["table"], e["key"]) for e in dropped} == {
        ("checkpoints", "big"),
        ("events", "000000000999"),
    }
    assert {e["reason"] for e in dropped} == {
        "step is an integer of 100 bits",
        "nbytes is an integer of 1329 bits",
    }
    said = [e["text"] for e in st["overview"]["timeline"] if e["kind"] == "journal_record_dropped"]
    assert (
        "journal record checkpoints/big dropped at restart: step is an integer of 100 bits" in said
    )
    used.kill()  # and they are gone from the journal: the next start drops nothing
    used.start()
    again = [e for e in used.status()["events"] if e["kind"] == "journal_record_dropped"]
    assert again == dropped
