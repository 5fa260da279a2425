"""Reading a ``phalanx run`` directory for the audit, from the files alone (the
controller has stopped): ``controller/config.json`` (the resolved config),
``controller/journal.sqlite`` (opened read-only: an audit never writes to a run),
each replica's ``<replica>.log`` (JSON event lines mixed with log lines) and
``final/*.safetensors``. A job dir of ``deploy/slurm/phalanx.sbatch`` is read the
same way: its replicas' lines are their agents' workers' (``agent-NAME[.K]/genG/
rank0.out``, in the order the agents started them).

A job started by another launcher (Kubernetes, a user's own scripts) has no run
directory: :func:`load_job` reads the served controller's state dir (its
``config.json`` and ``journal.sqlite``) and the replicas' output files instead, each
file's replica taken from its JSON lines' ``replica`` field (``name:incarnation``),
not from the file's name.

A directory that lacks what every run has raises :class:`~.base.NotARun` in one
line naming what is missing.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phalanx.audit.base import NotARun, Rollback, Run

NOT_REPLICA_LOGS = frozenset({"controller", "zygote", "etcd"})
"""Logs of a run directory that are not a replica's."""


def load_run(path: Path) -> Run:
    """The run at ``path``. Raises :class:`NotARun` (one line) when it is not one."""
    if not path.is_dir():
        why = "it is not a directory" if path.exists() else "it does not exist"
        raise NotARun(f"{path} is not a run directory: {why}.")
    cfg_path = path / "controller" / "config.json"
    if not cfg_path.is_file():
        raise NotARun(
            f"{path} is not a run directory: it has no controller/config.json (the resolved "
            f"config phalanx run writes). Give the directory phalanx run printed (runs/JOB-TIME "
            f"or --run-dir)."
        )
    config = _config(cfg_path)
    events = {
        p.stem: _events(p) for p in sorted(path.glob("*.log")) if p.stem not in NOT_REPLICA_LOGS
    }
    for name, outs in _agents_outputs(path).items():
        events.setdefault(name, [])
        for out in outs:
            events[name] += _events(out)
    if not events:
        raise NotARun(
            f"{path} is not a run directory: it has no replica log (<replica>.log) beside "
            f"controller/. Give the directory phalanx run printed."
        )
    finals = sorted((path / "final").glob("*.safetensors"))
    return _with_journal(Run(path, config, events, finals, None), path / "controller")


def load_job(state_dir: Path, logs: Sequence[Path], finals: Sequence[Path] = ()) -> Run:
    """A job that ``phalanx run`` did not start, from the served controller's state dir
    (``--state-dir``: ``config.json``, ``journal.sqlite``) and its replicas' outputs
    (their stdout: JSON event lines mixed with other lines), in the order given (a
    replica's restarts after its first run), and its final files. Each output is the
    replica its lines name (``replica``: ``name:incarnation``), whatever the file is
    called. Raises :class:`NotARun` (one line) when the state dir holds no resolved
    config, a file is not a replica's output, or no output holds a step."""
    if not state_dir.is_dir():
        why = "it is not a directory" if state_dir.exists() else "it does not exist"
        raise NotARun(f"{state_dir} is not a controller state dir: {why}.")
    cfg_path = state_dir / "config.json"
    if not cfg_path.is_file():
        raise NotARun(
            f"{state_dir} is not a controller state dir: it has no config.json (the resolved "
            f"config the served controller writes). Give the controller's --state-dir."
        )
    config = _config(cfg_path)
    if not logs:
        raise NotARun("no replica output given: name each replica's stdout file after the dir.")
    events: dict[str, list[dict[str, Any]]] = {}
    for log in logs:
        if not log.is_file():
            raise NotARun(f"{log} is not a replica's output: it is not a file.")
        evs = _events(log)
        name = next((str(e["replica"]) for e in evs if e.get("replica")), None)
        if name is None:
            raise NotARun(
                f"{log} is not a replica's output: no JSON event line names a replica. Give "
                f"the stdout of phalanx replica."
            )
        events.setdefault(name.split(":", 1)[0], []).extend(evs)
    if not any(e.get("event") == "step" for evs in events.values() for e in evs):
        raise NotARun(
            f"no step line in {len(logs)} replica output(s): none committed a step, or these "
            f"are not the outputs of the job in {state_dir}."
        )
    for f in finals:
        if not f.is_file():
            raise NotARun(f"{f} is not a final state: it is not a file.")
    return _with_journal(Run(state_dir, config, events, list(finals), None), state_dir)


def _with_journal(run: Run, state_dir: Path) -> Run:
    """``run`` with the policy's step and rollbacks from ``state_dir/journal.sqlite``."""
    journal = _journal(state_dir / "journal.sqlite")
    run.journal = journal
    if journal is not None:
        role = journal.get("meta", {}).get("role/policy")
        if role is not None:
            run.committed_step = int(role["step"])
            run.rollbacks = [
                Rollback(int(rb["quorum_id"]), int(rb["from_step"]), int(rb["to_step"]))
                for rb in role.get("rollbacks", [])
            ]
    return run


def _agents_outputs(path: Path) -> dict[str, list[Path]]:
    """Each replica's rank-0 outputs under its agents' run dirs (``agent-NAME`` and,
    for an agent started again elsewhere, ``agent-NAME.K``), oldest first."""
    found: dict[str, list[tuple[int, int, Path]]] = {}
    for d in path.glob("agent-*"):
        name, _, again = d.name.removeprefix("agent-").partition(".")
        if not d.is_dir() or (again and not again.isdigit()):
            continue
        for out in d.glob("gen*/rank0.out"):
            gen = out.parent.name.removeprefix("gen")
            if gen.isdigit():
                found.setdefault(name, []).append((int(again or 0), int(gen), out))
    return {name: [out for *_, out in sorted(outs)] for name, outs in found.items()}


def _config(path: Path) -> Any:
    from phalanx.config import JobConfig

    try:
        return JobConfig.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise NotARun(f"{path} is not a job's resolved config: {first}.") from None


def _events(path: Path) -> list[dict[str, Any]]:
    """The JSON event lines of one log, in order (other lines skipped; a line cut by a
    SIGKILL mid-write is skipped too)."""
    out = []
    with path.open("rb") as f:
        for raw in f:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("{"):
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and "event" in ev:
                out.append(ev)
    return out


def _journal(path: Path) -> dict[str, dict[str, dict[str, Any]]] | None:
    """The SQLite journal's tables, read-only; None when there is none (an etcd journal
    lives outside the run directory)."""
    if not path.is_file():
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise NotARun(f"{path} cannot be opened: {e}.") from None
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for tbl, key, value in db.execute("SELECT tbl, key, value FROM records"):
            tables.setdefault(tbl, {})[key] = json.loads(value)
    except (sqlite3.Error, ValueError) as e:
        raise NotARun(f"{path} is not a readable controller journal: {e}.") from None
    finally:
        db.close()
    return tables
