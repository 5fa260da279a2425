"""``phalanx audit`` on hand-made run directories: each violation is found and named,
a legitimate rollback is not one, and a directory that is not a run is one line."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from phalanx.audit import audit_checks
from phalanx.audit.rundir import load_run
from phalanx.cli import main
from phalanx.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BATCH = 4


def ft_step(rid: str, step: int, share: list[int], q: int = 1, parts: int = 2, **kw: Any) -> dict:
    return {
        "event": "step",
        "replica": rid,
        "step": step,
        "loss": kw.pop("loss", 1.0 / step),
        "participants": parts,
        "quorum_id": q,
        "healed": False,
        "cursor": step * BATCH,
        "samples": share,
        **kw,
    }


def ft_logs(steps: int = 3) -> dict[str, list[dict]]:
    """Two replicas that committed ``steps`` steps together, halves of each batch."""
    logs: dict[str, list[dict]] = {"policy-0": [], "policy-1": []}
    for s in range(1, steps + 1):
        ids = [BATCH * (s - 1) + i for i in range(BATCH)]
        logs["policy-0"].append(ft_step("policy-0:a", s, ids[:2]))
        logs["policy-1"].append(ft_step("policy-1:b", s, ids[2:]))
    return logs


def write_run(
    path: Path,
    logs: dict[str, list[dict]],
    *,
    rl: bool = False,
    step: int | None = None,
    rollbacks: list[dict] | None = None,
    ledger: dict | None = None,
    weight: float = 0.5,
) -> Path:
    """A run directory as ``phalanx run`` leaves one: the resolved config, a journal
    (the policy's step and rollbacks; an RL ledger's books), the replicas' logs (log
    lines mixed with JSON events) and the final states."""
    if rl:
        cfg = load_config(str(EXAMPLES / "sort_grpo.toml"), [])
    else:
        cfg = load_config(None, [f"--train.global_batch_size={BATCH}", "--train.dtype=float64"])
    (path / "controller").mkdir(parents=True)
    (path / "controller" / "config.json").write_text(cfg.model_dump_json())
    last = step if step is not None else max(e.get("step", 0) for v in logs.values() for e in v)
    meta = {"quorum_id": 1, "round": last, "step": last, "force_bump": False}
    tables: dict[str, dict[str, Any]] = {
        "meta": {"role/policy": {**meta, "rollbacks": rollbacks or [], "unproven_step": 0}}
    }
    if ledger is not None:
        tables["ledger"] = {"meta": ledger}
    db = sqlite3.connect(path / "controller" / "journal.sqlite")
    db.execute("CREATE TABLE records (tbl TEXT, key TEXT, value TEXT, PRIMARY KEY (tbl, key))")
    for tbl, rows in tables.items():
        for key, rec in rows.items():
            db.execute("INSERT INTO records VALUES (?, ?, ?)", (tbl, key, json.dumps(rec)))
    db.commit()
    db.close()
    for name, evs in logs.items():
        lines = ["07:00:00.000 I [policy] registered (epoch 1)"] + [json.dumps(e) for e in evs]
        (path / f"{name}.log").write_text("\n".join(lines) + "\n")
    (path / "final").mkdir()
    for name in logs:
        if name.startswith("policy"):
            t = {"w": torch.full((3,), weight, dtype=torch.float64)}
            save_file(t, str(path / "final" / f"{name}.safetensors"), {"step": str(last)})
    return path


def ledger_meta(n: int, trained_rollouts: int | None = None) -> dict:
    """An RL ledger's books after ``n`` prompts and their rollouts were all trained."""
    tr = n if trained_rollouts is None else trained_rollouts
    counts = {"trained_prompts": n, "dropped_prompts": 0, "trained_rollouts": tr}
    counts |= {"accepted": n, "duplicates": 0, "unleased": 0}
    counts |= {"leases_issued": 1, "leases_expired": 0}
    return {
        "cursor": n,
        "lease_seq": 1,
        "requeue": [],
        "seq": n,
        "next_batch": 2,
        "policy_step": 4,
        "discarded": {},
        "finished": True,
        "final_step": 4,
        "reopened": [],
        "want_version": 4,
        "synced_version": 4,
        "sync_seq": 2,
        "mesh_id": 1,
        "mesh": [],
        "counts": counts,
        "run": "r",
    }


def rl_step(step: int, batch: int, rollouts: list[str], q: int = 1) -> dict:
    return {
        "event": "step",
        "role": "policy",
        "replica": "policy-0:a",
        "step": step,
        "batch": batch,
        "loss": 0.1,
        "participants": 1,
        "quorum_id": q,
        "rollouts": rollouts,
    }


def rl_batches(*batches: list[str]) -> list[dict]:
    """The policy's lines for batches of two commits each (``inner_epochs`` 2): the
    second acknowledges the batch and lists its rollouts."""
    out = []
    for b, rollouts in enumerate(batches):
        out += [rl_step(2 * b + 1, b, []), rl_step(2 * b + 2, b, rollouts)]
    return out


def verdicts(path: Path, calm: Path | None = None) -> dict[str, Any]:
    checks = audit_checks(load_run(path), load_run(calm) if calm else None)
    return {c.name: (c.verdict, c.detail) for c in checks}


def failed(v: dict[str, Any]) -> list[str]:
    return sorted(k for k, (verdict, _) in v.items() if verdict == "FAIL")


def test_a_clean_run_passes_with_a_table_and_exit_0(tmp_path, capsys):
    run = write_run(tmp_path / "run", ft_logs())
    assert main(["audit", str(run)]) == 0
    out = capsys.readouterr().out
    assert "steps.once" in out and "pass" in out and "FAIL" not in out
    assert main(["audit", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and {c["check"] for c in doc["checks"]} >= {"steps.once", "final.same"}


def test_a_step_committed_twice_with_different_contents(tmp_path, capsys):
    logs = ft_logs()
    logs["policy-1"][1]["loss"] = 9.0  # step 2: the two replicas disagree
    run = write_run(tmp_path / "run", logs)
    v = verdicts(run)
    assert failed(v) == ["steps.once"]
    assert "step 2 (quorum 1) committed with different loss" in v["steps.once"][1]
    assert main(["audit", str(run)]) == 1
    capsys.readouterr()


def test_a_step_committed_again_in_a_later_quorum_without_a_rollback(tmp_path):
    logs = ft_logs()
    # A new incarnation commits step 3 again in quorum 2: no rollback allows it.
    logs["policy-1"].append(ft_step("policy-1:c", 3, [8, 9, 10, 11], q=2, parts=1))
    v = verdicts(write_run(tmp_path / "run", logs))
    assert failed(v) == ["steps.once"]
    assert "step 3 committed in quorum 1 and again in quorum 2" in v["steps.once"][1]


def test_a_cut_off_replicas_lone_commit_healed_away_is_a_discarded_branch(tmp_path):
    """A partition inside step 3's all-reduce: policy-0 (its sends lost, its peer's
    arriving) finished step 3 alone in quorum 1; policy-1 timed out and committed it
    again in quorum 2 without it; policy-0's incarnation ended there and its name came
    back healed. Not a second commit; the same, had policy-0:a gone on, would be."""
    logs = ft_logs(2)
    logs["policy-0"].append(ft_step("policy-0:a", 3, [8, 9]))  # alone, 2 took part
    logs["policy-1"].append(ft_step("policy-1:b", 3, [8, 9, 10, 11], q=2, parts=1))
    logs["policy-1"].append(ft_step("policy-1:b", 4, [12, 13], q=3))
    logs["policy-0"].append(ft_step("policy-0:c", 4, [14, 15], q=3))  # healed, new incarnation
    v = verdicts(write_run(tmp_path / "run", logs, step=4))
    assert "steps.once" not in failed(v), v["steps.once"]
    assert "1 commit(s) on a cut-off branch, discarded" in v["steps.once"][1]
    assert "step 3 by policy-0:a (quorum 1)" in v["steps.once"][1]

    logs["policy-0"].append(ft_step("policy-0:a", 4, [12, 13], q=1))  # the branch went on
    v = verdicts(write_run(tmp_path / "on", logs, step=4))
    assert "step 3 committed in quorum 1 and again in quorum 2" in v["steps.once"][1]


def test_steps_going_backwards(tmp_path):
    logs = ft_logs()
    logs["policy-0"].append(ft_step("policy-0:a", 2, [4, 5], q=2, loss=0.5))
    v = verdicts(write_run(tmp_path / "run", logs))
    assert "steps.order" in failed(v)
    assert "policy-0:a went back from step 3 (quorum 1) to 2 (quorum 2)" in v["steps.order"][1]


def test_a_journaled_rollback_is_not_a_violation(tmp_path):
    # The RL policy committed steps 1-4 in quorum 1, was killed, and the job rolled
    # back to step 2 (quorum 2): steps 3-4 are committed again, batch 1 trained again.
    logs = {
        "policy-0": [
            rl_step(1, 0, []),
            rl_step(2, 0, ["p0.0", "p1.0"]),
            rl_step(3, 1, []),
            rl_step(4, 1, ["p2.0", "p3.0"]),
            rl_step(3, 1, [], q=2),
            rl_step(4, 1, ["p2.0", "p3.0"], q=2),
        ],
        "rollout-0": [{"event": "rollout", "replica": "rollout-0:r", "n": 4}],
    }
    rb = [{"quorum_id": 2, "from_step": 4, "to_step": 2, "at": 0.0}]
    v = verdicts(write_run(tmp_path / "run", logs, rl=True, rollbacks=rb, ledger=ledger_meta(4)))
    assert failed(v) == [], v
    assert "again after a rollback" in v["steps.once"][1]
    # Without the journal's rollback the same logs are two violations.
    v = verdicts(write_run(tmp_path / "norb", logs, rl=True, ledger=ledger_meta(4)))
    assert {"steps.once", "steps.order", "ledger.trained_once"} <= set(failed(v))


def test_an_rl_policy_killed_before_its_step_was_saved_trains_it_again(tmp_path):
    # policy-0:a printed step 3 (quorum 1), then died before a save held it; policy-0:b
    # resumed from the save of step 2 and trained step 3 again in quorum 2.
    a = [rl_step(1, 0, []), rl_step(2, 0, ["p0.0", "p1.0"]), rl_step(3, 1, [])]
    b = [{**rl_step(s, 1, r, q=2), "replica": "policy-0:b"} for s, r in ((3, []), (4, ["p2.0"]))]
    logs = {"policy-0": a + b, "rollout-0": [{"event": "rollout", "replica": "rollout-0:r"}]}
    v = verdicts(write_run(tmp_path / "run", logs, rl=True, ledger=ledger_meta(3)))
    assert "steps.once" not in failed(v), v["steps.once"]
    assert "step 3 by policy-0:a (quorum 1)" in v["steps.once"][1]


def test_a_step_missing_from_every_log(tmp_path):
    logs = ft_logs(4)
    for evs in logs.values():
        del evs[2]  # step 3: committed (the journal's step is 4) but printed by no one
    v = verdicts(write_run(tmp_path / "run", logs))
    assert failed(v) == ["steps.complete"]
    assert "step(s) 3 committed (journal: 4) but in no log" in v["steps.complete"][1]


def test_a_prompt_trained_twice(tmp_path):
    logs = {"policy-0": rl_batches(["p0.0", "p1.0"], ["p0.1", "p2.0"])}
    v = verdicts(write_run(tmp_path / "run", logs, rl=True, ledger=ledger_meta(4)))
    assert failed(v) == ["ledger.trained_once"]
    assert "prompt 0 trained in batches 0 and 1" in v["ledger.trained_once"][1]


def test_an_unbalanced_ledger(tmp_path):
    logs = {"policy-0": rl_batches(["p0.0", "p1.0"], ["p2.0", "p3.0"])}
    led = ledger_meta(4, trained_rollouts=3)  # 4 accepted, 3 trained, none elsewhere
    v = verdicts(write_run(tmp_path / "run", logs, rl=True, ledger=led))
    assert failed(v) == ["ledger.balance"]
    assert "does not balance" in v["ledger.balance"][1]
    assert "3 rollouts trained, the policy's logs 4" in v["ledger.balance"][1]


def test_final_files_of_one_run_that_differ(tmp_path):
    run = write_run(tmp_path / "run", ft_logs())
    save_file({"w": torch.zeros(3, dtype=torch.float64)}, str(run / "final/policy-1.safetensors"))
    v = verdicts(run)
    assert failed(v) == ["final.same"]


def test_against_a_calm_run(tmp_path, capsys):
    calm = write_run(tmp_path / "calm", ft_logs())
    same = write_run(tmp_path / "same", ft_logs())
    v = verdicts(same, calm)
    assert failed(v) == []
    assert "3 global batches equal" in v["against.batches"][1]
    assert "bit-identical" in v["against.final"][1]  # same participants at every step

    swapped = ft_logs()
    for r in ("policy-0", "policy-1"):  # step 2 trained samples 8-11, step 3 4-7
        a, b = swapped[r][1]["samples"], swapped[r][2]["samples"]
        swapped[r][1]["samples"], swapped[r][2]["samples"] = b, a
    v = verdicts(write_run(tmp_path / "swapped", swapped), calm)
    assert failed(v) == ["against.batches"]
    assert "step 2: global batch differs" in v["against.batches"][1]

    off = write_run(tmp_path / "off", ft_logs(), weight=0.5 + 1e-6)
    v = verdicts(off, calm)
    assert failed(v) == ["against.final"]
    assert main(["audit", str(off), "--against", str(calm)]) == 1
    capsys.readouterr()


def test_against_tolerates_rounding_when_membership_changed(tmp_path):
    calm = write_run(tmp_path / "calm", ft_logs())
    logs = ft_logs()
    # Step 3 committed by policy-0 alone (policy-1 was killed): the whole batch, one share.
    logs["policy-1"].pop()
    logs["policy-0"][2] = ft_step("policy-0:a", 3, [8, 9, 10, 11], parts=1)
    near = write_run(tmp_path / "near", logs, weight=0.5 + 1e-12)
    (near / "final" / "policy-1.safetensors").unlink()
    v = verdicts(near, calm)
    assert failed(v) == [], v
    assert "within 1e-09" in v["against.final"][1]
    far = write_run(tmp_path / "far", logs, weight=0.5 + 1e-6)
    (far / "final" / "policy-1.safetensors").unlink()
    assert failed(verdicts(far, calm)) == ["against.final"]


def test_against_bit_identical_unless_the_split_changed(tmp_path):
    calm = write_run(tmp_path / "calm", ft_logs())
    # A straggler's smaller share at step 2: the same batch, split 1 + 3.
    logs = ft_logs()
    logs["policy-0"][1]["samples"], logs["policy-1"][1]["samples"] = [4], [5, 6, 7]
    v = verdicts(write_run(tmp_path / "split", logs, weight=0.5 + 1e-12), calm)
    assert failed(v) == [], v
    assert "within 1e-09" in v["against.final"][1]
    # A replica killed before it printed step 2: the other's size and the count fix
    # the split, which is the calm run's, so the states must still be bit-identical.
    logs = ft_logs()
    logs["policy-1"].pop(1)
    v = verdicts(write_run(tmp_path / "unprinted", logs, weight=0.5 + 1e-12), calm)
    assert failed(v) == ["against.final"]
    assert "differs by 1e-12 > 0" in v["against.final"][1]  # no tolerance


@pytest.mark.parametrize("what", ["missing", "file", "empty", "no-logs"])
def test_not_a_run_is_one_line_and_exit_2(tmp_path, capsys, what):
    path = tmp_path / "x"
    if what == "file":
        path.write_text("hi")
    elif what == "empty":
        path.mkdir()
    elif what == "no-logs":
        run = write_run(path, ft_logs())
        for log in run.glob("*.log"):
            log.unlink()
    assert main(["audit", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("phalanx audit: ") and "run" in err


# -- data.samples: each global batch is the sampler's -----------------------------

DATASET = 10  # with BATCH 4, batches straddle epochs (an index may repeat in one)


def sampler_logs(steps: int = 6) -> dict[str, list[dict]]:
    """Two replicas that committed ``steps`` steps of the sampler's stream (seed 0)."""
    from phalanx.data.sampler import ElasticSampler

    s = ElasticSampler(DATASET, seed=0)
    logs: dict[str, list[dict]] = {"policy-0": [], "policy-1": []}
    for step in range(1, steps + 1):
        ids = s.positions((step - 1) * BATCH, BATCH)
        for name, rid, share in (
            ("policy-0", "policy-0:a", ids[:2]),
            ("policy-1", "policy-1:b", ids[2:]),
        ):
            logs[name].append(ft_step(rid, step, share, dataset_size=DATASET))
    return logs


def verdict(path: Path, name: str) -> tuple[str, str]:
    (c,) = [c for c in audit_checks(load_run(path)) if c.name == name]
    return c.verdict, c.detail


def test_data_samples_passes_the_samplers_batches_and_finds_one_out_of_turn(tmp_path: Path):
    assert verdict(write_run(tmp_path / "ok", sampler_logs()), "data.samples") == (
        "pass", "6 global batches are the sampler's",
    )  # fmt: skip
    logs = sampler_logs()
    logs["policy-1"][3]["samples"] = logs["policy-1"][4]["samples"]  # step 5's ids at step 4
    got = verdict(write_run(tmp_path / "bad", logs), "data.samples")
    assert got == ("FAIL", "step 4: global batch is not the sampler's for the step")
    logs = sampler_logs()
    for e in logs["policy-0"] + logs["policy-1"]:
        e.pop("dataset_size")  # train.log_samples off, or logs of an older phalanx
    assert verdict(write_run(tmp_path / "none", logs), "data.samples")[0] == "skip"


def test_data_samples_takes_a_step_short_of_a_killed_replicas_share(tmp_path: Path):
    logs = sampler_logs()
    del logs["policy-1"][3:]  # policy-1:b died after committing step 4, before its line
    for e in sampler_logs()["policy-1"][4:]:  # its next incarnation took part from step 5
        logs["policy-1"].append({**e, "replica": "policy-1:c"})
    logs["policy-1"].append({"event": "done", "replica": "policy-1:c", "step": 6})
    logs["policy-0"].append({"event": "done", "replica": "policy-0:a", "step": 6})
    verdict_, detail = verdict(write_run(tmp_path / "ok", logs), "data.samples")
    assert verdict_ == "pass" and "1 short of a killed replica's share" in detail, detail
    logs["policy-1"].append({"event": "done", "replica": "policy-1:b", "step": 3})
    assert verdict(write_run(tmp_path / "nobody-died", logs), "data.samples") == (
        "FAIL", "1 step(s) lack a participant's share, more than the 0 incarnation(s) that died",
    )  # fmt: skip
    logs["policy-1"] = [
        e for e in logs["policy-1"] if e["replica"] != "policy-1:b" or e["event"] != "done"
    ]
    logs["policy-0"][3]["samples"] = [logs["policy-0"][3]["samples"][0]] * 2
    assert verdict(write_run(tmp_path / "twice", logs), "data.samples") == (
        "FAIL", "step 4: its printed shares are not distinct parts of its batch",
    )  # fmt: skip
