"""``phalanx audit --state-dir DIR LOG ...`` (:func:`phalanx.audit.load_job`): a job
another launcher started, read from its controller's state dir and its replicas'
stdout files; and the checks the integration tests' own copies made, now the audit's:
one state per step (``state_hash``), a whole-job resume, a journal behind the logs,
synchronous DiLoCo rounds, the ledger's trained prompts."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from test_audit import BATCH, ft_logs, ft_step, ledger_meta, rl_batches, write_run

from phalanx.audit import audit_checks, load_job
from phalanx.cli import main
from phalanx.config import load_config


def write_job(
    root: Path, outputs: dict[str, list[dict]], args: list[str] | None = None, step: int = 3
) -> tuple[Path, list[Path]]:
    """A served controller's state dir (``config.json``, ``journal.sqlite`` at the
    policy's ``step``) and each output file (named unlike its replica: a launcher's
    own names), log lines mixed with the JSON events."""
    state = root / "state"
    state.mkdir(parents=True)
    cfg = load_config(None, [f"--train.global_batch_size={BATCH}", *(args or [])])
    (state / "config.json").write_text(cfg.model_dump_json())
    db = sqlite3.connect(state / "journal.sqlite")
    db.execute("CREATE TABLE records (tbl TEXT, key TEXT, value TEXT, PRIMARY KEY (tbl, key))")
    meta = {"quorum_id": 1, "round": step, "step": step, "force_bump": False, "rollbacks": []}
    db.execute("INSERT INTO records VALUES ('meta', 'role/policy', ?)", (json.dumps(meta),))
    db.commit()
    db.close()
    paths = []
    for name, evs in outputs.items():
        p = root / name
        p.write_text("\n".join(["I [replica] starting", *map(json.dumps, evs)]) + "\n")
        paths.append(p)
    return state, paths


def verdicts(state: Path, logs: list[Path]) -> dict[str, tuple[str, str]]:
    return {c.name: (c.verdict, c.detail) for c in audit_checks(load_job(state, logs))}


def failed(v: dict[str, Any]) -> list[str]:
    return sorted(k for k, (verdict, _) in v.items() if verdict == "FAIL")


def test_a_job_from_its_state_dir_and_outputs_passes_with_exit_0(tmp_path: Path, capsys):
    logs = ft_logs()
    state, paths = write_job(tmp_path, {"01-x.out": logs["policy-0"], "02-y.out": logs["policy-1"]})
    run = load_job(state, paths)
    assert sorted(run.events) == ["policy-0", "policy-1"]  # the lines' names, not the files'
    assert main(["audit", "--state-dir", str(state), *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"audit of the job of {state}") and "FAIL" not in out
    assert "steps 1..3 all in the logs" in out
    assert main(["audit", "--state-dir", str(state), str(paths[0]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["state_dir"] == str(state)


def test_a_replicas_restart_in_another_file_is_the_same_replica(tmp_path: Path):
    logs = ft_logs(4)
    first, again = (
        logs["policy-1"][:2],
        [{**e, "replica": "policy-1:c"} for e in logs["policy-1"][2:]],
    )
    files = {"a.out": logs["policy-0"], "b.out": first, "b-again.out": again}
    state, paths = write_job(tmp_path, files, step=4)
    assert failed(verdicts(state, paths)) == []
    assert len(load_job(state, paths).events["policy-1"]) == 4


@pytest.mark.parametrize("what", ["no-dir", "no-config", "not-a-replica", "no-step", "no-logs"])
def test_not_a_job_is_one_line_and_exit_2(tmp_path: Path, capsys, what: str):
    logs = ft_logs()
    state, paths = write_job(tmp_path, {"a.out": logs["policy-0"]})
    if what == "no-dir":
        state = tmp_path / "nowhere"
    elif what == "no-config":
        (state / "config.json").unlink()
    elif what == "not-a-replica":
        paths[0].write_text("just text\n" + json.dumps({"event": "hello"}) + "\n")
    elif what == "no-step":
        paths[0].write_text(json.dumps({"event": "start", "replica": "policy-0:a"}) + "\n")
    args = ["audit", "--state-dir", str(state), *(map(str, paths) if what != "no-logs" else [])]
    if what == "no-logs":  # argparse: the outputs are required
        with pytest.raises(SystemExit):
            main(args)
        return
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("phalanx audit: "), err


def test_outputs_without_state_dir_is_one_line(tmp_path: Path):
    with pytest.raises(SystemExit, match="needs --state-dir") as e:
        main(["audit", str(tmp_path / "a.out"), str(tmp_path / "b.out")])
    assert len(str(e.value).splitlines()) == 1


def test_replicas_of_one_step_with_different_states(tmp_path: Path):
    logs = ft_logs()
    for name in logs:
        for e in logs[name]:
            e["state_hash"] = "0000abcd"
    logs["policy-1"][1]["state_hash"] = "ffff0000"
    v = verdicts(*write_job(tmp_path, logs))
    assert failed(v) == ["steps.once"]
    assert "step 2 (quorum 1) committed with different state_hash" in v["steps.once"][1]


def test_the_journal_behind_the_logs_is_no_violation_a_gap_is(tmp_path: Path):
    # The job's last step is never journaled when no quorum or heartbeat follows it.
    assert failed(verdicts(*write_job(tmp_path / "behind", ft_logs(), step=2))) == []
    logs = ft_logs(4)
    for name in logs:
        del logs[name][2]  # step 3
    v = verdicts(*write_job(tmp_path / "gap", logs, step=2))
    assert failed(v) == ["steps.complete"]
    assert "step(s) 3 committed (journal: 2) but in no log" in v["steps.complete"][1]


def test_a_job_resumed_whole_from_a_checkpoint_starts_after_it(tmp_path: Path):
    logs = ft_logs(6)
    for name in logs:
        del logs[name][:3]  # steps 1..3 are the checkpoint's, trained by an earlier job
        logs[name].insert(
            0, {"event": "start", "replica": logs[name][0]["replica"], "resumed_from": 3}
        )
    v = verdicts(*write_job(tmp_path / "resumed", logs, step=6))
    assert failed(v) == [] and "resumed from the checkpoint of step 3" in v["steps.complete"][1]
    for name in logs:
        logs[name][0]["resumed_from"] = None  # (a fresh start: steps 1..3 are missing)
    v = verdicts(*write_job(tmp_path / "fresh", logs, step=6))
    assert failed(v) == ["steps.complete"] and "step(s) 1-3" in v["steps.complete"][1]


def test_sync_diloco_rounds_are_the_samplers_h_batches(tmp_path: Path):
    from phalanx.data.sampler import ElasticSampler

    h, size = 2, 10
    s = ElasticSampler(size, seed=0)
    logs: dict[str, list[dict]] = {"a.out": [], "b.out": []}
    for rnd in range(1, 4):
        ids = s.positions((rnd - 1) * h * BATCH, h * BATCH)
        for name, rid, share in (
            ("a.out", "policy-0:a", ids[::2]),
            ("b.out", "policy-1:b", ids[1::2]),
        ):
            logs[name].append(ft_step(rid, rnd, share, cursor=rnd * h * BATCH, dataset_size=size))
    args = [f"--diloco.sync_every={h}", f"--train.steps={3 * h}"]
    v = verdicts(*write_job(tmp_path / "ok", logs, args))
    assert failed(v) == [] and v["data.samples"][0] == "pass", v
    logs["b.out"][1]["samples"] = logs["b.out"][2]["samples"]
    logs["a.out"][0]["cursor"] = logs["b.out"][0]["cursor"] = BATCH  # one batch, not H
    v = verdicts(*write_job(tmp_path / "bad", logs, args))
    assert failed(v) == ["data.samples", "steps.complete"], v
    assert "step 2: global batch is not the sampler's" in v["data.samples"][1]
    assert "expected 8 (step x 8 samples a step)" in v["steps.complete"][1]


def test_the_ledgers_trained_prompts_against_the_policys_lines(tmp_path: Path):
    logs = {"policy-0": rl_batches(["p0.0", "p1.0"], ["p2.0", "p3.0"])}
    led = ledger_meta(4)
    assert failed(verdicts_of_run(write_run(tmp_path / "ok", logs, rl=True, ledger=led))) == []
    led["counts"] |= {"trained_prompts": 3, "dropped_prompts": 1}  # balances, but 3 != 4
    v = verdicts_of_run(write_run(tmp_path / "bad", logs, rl=True, ledger=led))
    assert failed(v) == ["ledger.balance"]
    assert "the ledger counts 3 prompts trained, the policy's logs 4" in v["ledger.balance"][1]


def verdicts_of_run(path: Path) -> dict[str, tuple[str, str]]:
    from phalanx.audit import load_run

    return {c.name: (c.verdict, c.detail) for c in audit_checks(load_run(path))}
