"""Universal checkpoints in one process: round trips on every local backend,
the commit protocol, async save, corruption fallback, and ``phalanx ckpt``.
Subprocesses (SIGKILL mid-save) and S3 are in
``tests/integration/test_checkpoint_storage.py``."""

from __future__ import annotations

import json
import logging
import random
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from phalanx.checkpoint import Checkpointer, CheckpointError, CheckpointStore
from phalanx.checkpoint.base import LATEST, MANIFEST, METADATA, step_dir
from phalanx.checkpoint.store import STAGING
from phalanx.cli import main
from phalanx.train.manager import rng_state, set_rng_state

LOG = "phalanx.checkpoint"


# -- helpers ------------------------------------------------------------------


def make_state(seed: int = 0, width: int = 16) -> dict[str, Any]:
    """A replica's full state: model, AdamW after a step, step, cursor, RNG, config."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 41 + seed,
        "data": {"cursor": 1234 + seed, "epoch": 2},
        "rng": rng_state(),
        "config": {"lr": 1e-3, "betas": [0.9, 0.95], "name": "mlp", "nested": {"tp": 1}},
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact equality of two state trees (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(
            a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b
        ), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    else:
        assert a == b and type(a) is type(b), f"{path}: {a!r} != {b!r}"


def zeros_like_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: zeros_like_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [zeros_like_tree(v) for v in tree]
    return tree


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno >= logging.ERROR]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    out, err = capsys.readouterr()
    return rc, out, err


# -- round trips ----------------------------------------------------------------


@pytest.fixture(params=["path", "file-url", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "path":
        return str(tmp_path / "ckpt")
    if request.param == "file-url":
        return f"file://{tmp_path}/ckpt"
    return f"memory://phalanx-test-{uuid.uuid4().hex[:8]}/ckpt"


def test_full_state_round_trips_bit_exact(root: str) -> None:
    state = make_state()
    ck = Checkpointer(root)
    ck.save(state["step"], state)

    # Without a template: every tensor comes back, int keys and tuples too.
    res = Checkpointer(root).load()
    assert res is not None and res.step == state["step"] and not res.skipped
    assert_same(state, res.state)

    # With a template: the model's and optimizer's own tensors are filled in place.
    fresh = make_state(seed=5)
    template = {"model": fresh["model"], "optim": fresh["optim"]}
    before = fresh["model"]["0.weight"]
    res = Checkpointer(root).load(template)
    assert res is not None
    assert res.state["model"]["0.weight"].data_ptr() == before.data_ptr()  # same storage
    assert_same(state["model"], fresh["model"])
    assert_same(state["optim"]["state"], fresh["optim"]["state"])

    # The loaded optimizer state and RNG state are usable as they are.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.load_state_dict(res.state["model"])
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(res.state["optim"])
    set_rng_state(res.state["rng"])
    draws = (torch.rand(3), np.random.rand(), random.random())
    set_rng_state(state["rng"])
    assert (torch.rand(3).tolist(), np.random.rand(), random.random()) == (
        draws[0].tolist(),
        draws[1],
        draws[2],
    )


def test_non_tensors_live_in_the_manifest_as_json(tmp_path: Path) -> None:
    state = make_state()
    Checkpointer(str(tmp_path)).save(3, state, extra={"run": "r1"})
    doc = json.loads((tmp_path / step_dir(3) / MANIFEST).read_text())
    assert doc["extra"] == {"run": "r1"}
    assert "model/0.weight" in doc["tensors"] and "optim/state/0/exp_avg" in doc["tensors"]
    raw = b"".join(p.read_bytes() for p in (tmp_path / step_dir(3)).iterdir())
    assert b"pickle" not in raw and b"\x80\x04\x95" not in raw  # no pickle protocol header


# -- commit protocol ------------------------------------------------------------


def test_data_then_metadata_then_manifest_then_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = Checkpointer(str(tmp_path))
    ck.save(1, {"w": torch.ones(4)})
    fs, store = ck.store.fs, ck.store
    events: list[str] = []
    real_open, real_pipe, real_mv = fs.open, fs.pipe_file, fs.mv

    def name(p: str) -> str:
        return p.rstrip("/").rsplit("/", 1)[-1].split(".tmp-")[0]

    def open_(path: str, mode: str = "rb", *a: Any, **k: Any) -> Any:
        if "w" in mode and ".tmp-" not in path:
            events.append(name(path))
        return real_open(path, mode, *a, **k)

    def pipe_(path: str, *a: Any, **k: Any) -> Any:
        events.append(name(path))
        return real_pipe(path, *a, **k)

    def mv_(src: str, dst: str, *a: Any, **k: Any) -> Any:
        events.append(f"mv:{name(dst)}")
        if name(dst) == LATEST:
            # latest moves only once the step is committed in place.
            assert store.fs.exists(f"{store.path(2)}/{MANIFEST}")
            assert json.loads(store.fs.cat_file(f"{store.root}/{LATEST}"))["step"] == 1
        return real_mv(src, dst, *a, **k)

    monkeypatch.setattr(fs, "open", open_)
    monkeypatch.setattr(fs, "pipe_file", pipe_)
    monkeypatch.setattr(fs, "mv", mv_)
    ck.save(2, {"w": torch.ones(4)})
    monkeypatch.undo()
    events = [e for i, e in enumerate(events) if not i or events[i - 1] != e]  # pipe_file opens
    assert events == [
        "data-r0.bin",
        METADATA,
        f"mv:{MANIFEST}",
        f"mv:{step_dir(2)}",
        f"mv:{LATEST}",
    ]
    assert store.latest() == 2


def test_failed_commit_keeps_latest_and_lists_nothing_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = Checkpointer(str(tmp_path))
    ck.save(1, {"w": torch.ones(4)})
    real = ck.store.put_atomic

    def fail_manifest(path: str, data: bytes) -> None:
        if path.endswith(MANIFEST):
            raise OSError("disk full (injected)")
        real(path, data)

    monkeypatch.setattr(ck.store, "put_atomic", fail_manifest)
    with pytest.raises(OSError, match="injected"):
        ck.save(2, {"w": torch.zeros(4)})
    store = CheckpointStore(str(tmp_path))
    assert store.steps() == [1] and store.latest() == 1
    res = Checkpointer(str(tmp_path)).load()
    assert res is not None and res.step == 1 and torch.equal(res.state["w"], torch.ones(4))


def test_keep_last_retention(tmp_path: Path) -> None:
    ck = Checkpointer(str(tmp_path), keep_last=2)
    for s in range(1, 6):
        ck.save(s, {"w": torch.full((3,), float(s))})
    assert ck.store.steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        step_dir(4),
        step_dir(5),
    ]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        Checkpointer(str(tmp_path), keep_last=0)


def test_abandoned_partial_saves_are_never_listed_and_are_cleaned(tmp_path: Path) -> None:
    ck = Checkpointer(str(tmp_path))
    ck.save(1, {"w": torch.ones(4)})
    # A killed local save (staging dir) and a killed object-store save (step dir
    # without a manifest), both older than the next commit, and one newer.
    old_staging = tmp_path / STAGING / f"{step_dir(2)}-deadbeef"
    old_staging.mkdir(parents=True)
    (old_staging / "data-r0.bin").write_bytes(b"x" * 100)
    no_manifest = tmp_path / step_dir(3)
    no_manifest.mkdir()
    (no_manifest / "data-r0.bin").write_bytes(b"x" * 100)
    newer = tmp_path / STAGING / f"{step_dir(9)}-cafef00d"
    newer.mkdir()
    assert ck.store.steps() == [1] and ck.store.latest() == 1
    res = Checkpointer(str(tmp_path)).load()
    assert res is not None and res.step == 1

    ck.save(4, {"w": torch.ones(4)})
    assert not old_staging.exists() and not no_manifest.exists()
    assert newer.exists()  # may be a save still in flight: left alone
    assert ck.store.steps() == [1, 4]


# -- async save -------------------------------------------------------------------


def test_async_save_snapshots_then_persists_while_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = Checkpointer(str(tmp_path), layout={"replicas": 3})
    w = torch.arange(1 << 20, dtype=torch.float32)  # 4 MB
    state = {"model": {"w": w}, "step": 7}
    expected = w.clone()

    # Hold the background writer at its data file until training has moved on.
    gate, writing = threading.Event(), threading.Event()
    real_open = ck.store.fs.open

    def gated_open(path: str, mode: str = "rb", *a: Any, **k: Any) -> Any:
        if "w" in mode and path.endswith(".bin"):
            writing.set()
            assert gate.wait(10), "test gate never opened"
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(ck.store.fs, "open", gated_open)
    fut = ck.save_async(7, state)
    assert writing.wait(10)
    for _ in range(3):  # training steps, in place, while the save is in flight
        w.mul_(0.5).add_(1.0)
    state["step"] = 8
    ck.layout = {"replicas": 2}  # the next save's layout (a replica left)
    assert not fut.done()
    gate.set()
    manifest = fut.result(timeout=30)
    monkeypatch.undo()
    assert manifest is not None and manifest.step == 7
    assert manifest.layout == {"replicas": 3}, "a save records the layout it began with"
    res = Checkpointer(str(tmp_path)).load()
    assert res is not None and res.step == 7 and res.state["step"] == 7
    assert torch.equal(res.state["model"]["w"], expected)
    assert not torch.equal(w, expected)
    ck.close()


def test_async_stall_excludes_the_persist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stall is the host copy only; the write (here made slow, as on a busy
    disk or an object store) is not in it. bench/checkpoint.py measures the
    real ratio; timing ratios are too noisy on a shared 2-core CI machine."""
    ck = Checkpointer(str(tmp_path))
    state = {"model": {f"w{i}": torch.randn(1 << 18) for i in range(4)}}  # 4 MB
    real_open = ck.store.fs.open

    def slow_open(path: str, mode: str = "rb", *a: Any, **k: Any) -> Any:
        if "w" in mode and path.endswith(".bin"):
            time.sleep(0.5)
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(ck.store.fs, "open", slow_open)
    t0 = time.perf_counter()
    fut = ck.save_async(1, state)
    returned_s = time.perf_counter() - t0
    fut.result(timeout=60)
    assert ck.last_save_s >= 0.5
    assert ck.last_stall_s <= returned_s < 0.5 * ck.last_save_s, (returned_s, ck.last_save_s)
    ck.close()


# -- corruption -----------------------------------------------------------------


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


CORRUPTIONS = {
    "truncated data file": lambda d: (d / "data-r0.bin").write_bytes(
        (d / "data-r0.bin").read_bytes()[:-10]
    ),
    "deleted .metadata": lambda d: (d / METADATA).unlink(),
    "flipped data bytes": lambda d: _flip(d / "data-r0.bin", 100),
    "flipped manifest bytes": lambda d: _flip(d / MANIFEST, len((d / MANIFEST).read_bytes()) // 2),
}
REASONS = {
    "truncated data file": "data-r0.bin has",
    "deleted .metadata": ".metadata is missing",
    "flipped data bytes": "data-r0.bin fails its checksum",
    "flipped manifest bytes": "phalanx.json is unreadable",
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_detected_and_falls_back(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = Checkpointer(str(tmp_path))
    old, new = make_state(seed=0), make_state(seed=1)
    ck.save(1, old)
    ck.save(2, new)
    CORRUPTIONS[kind](tmp_path / step_dir(2))

    template = zeros_like_tree({"model": make_state()["model"]})
    with caplog.at_level(logging.INFO, logger=LOG):
        res = Checkpointer(str(tmp_path)).load(template)
    assert res is not None and res.step == 1
    assert res.skipped and res.skipped[0][0] == 2 and REASONS[kind] in res.skipped[0][1]
    assert_same(old["model"], template["model"])
    assert_same(old["optim"]["state"], res.state["optim"]["state"])
    lines = errors(caplog)
    assert len(lines) == 1, lines
    assert "checkpoint step 2 is unusable" in lines[0] and REASONS[kind] in lines[0]
    assert "falling back to step 1" in lines[0]


def test_fallback_goes_only_to_an_older_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 20: a corrupt step 30 fell back to a garbage step-999 directory ("falling
    back to step 999"). A step the latest pointer never named is not a fallback: only
    older ones are, and the newer one is reported."""
    ck = Checkpointer(str(tmp_path))
    ck.save(10, make_state(seed=0))
    ck.save(30, make_state(seed=1))
    shutil.copytree(tmp_path / step_dir(30), tmp_path / step_dir(999))  # whole, but unnamed
    _flip(tmp_path / step_dir(30) / "data-r0.bin", 100)
    template = zeros_like_tree({"model": make_state()["model"]})
    with caplog.at_level(logging.INFO, logger=LOG):
        res = Checkpointer(str(tmp_path)).load(template)
    assert res is not None and res.step == 10 and [s for s, _ in res.skipped] == [30]
    assert_same(make_state(seed=0)["model"], template["model"])
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "falling back to step 10" in text and "falling back to step 999" not in text
    assert "steps 999 under" in text and "newer than the latest one committed (step 30)" in text


def test_deleted_latest_pointer_uses_the_newest_commit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = Checkpointer(str(tmp_path))
    ck.save(1, make_state(seed=0))
    ck.save(2, make_state(seed=1))
    (tmp_path / LATEST).unlink()
    with caplog.at_level(logging.INFO, logger=LOG):
        res = Checkpointer(str(tmp_path)).load()
    assert res is not None and res.step == 2 and not res.skipped
    assert_same(make_state(seed=1)["model"], res.state["model"])
    assert not errors(caplog)


def test_nothing_usable_raises_and_leaves_the_template_untouched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = Checkpointer(str(tmp_path))
    ck.save(1, make_state(seed=0))
    ck.save(2, make_state(seed=1))
    _flip(tmp_path / step_dir(2) / "data-r0.bin", 10)
    (tmp_path / step_dir(1) / "data-r0.bin").write_bytes(b"")
    template = zeros_like_tree(make_state(seed=3))
    keep = zeros_like_tree(template)
    with caplog.at_level(logging.INFO, logger=LOG), pytest.raises(CheckpointError) as e:
        Checkpointer(str(tmp_path)).load(template)
    msg = str(e.value)
    assert "no usable checkpoint" in msg and "step 2:" in msg and "step 1:" in msg
    assert "start without resuming" in msg
    assert_same(keep, template)
    assert len(errors(caplog)) == 2


def test_no_checkpoint_at_all_returns_none(tmp_path: Path) -> None:
    assert Checkpointer(str(tmp_path / "empty")).load() is None


@pytest.mark.parametrize("change", ["other shapes", "missing keys", "other dtype"])
def test_incompatible_model_is_reported_clearly(
    change: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    Checkpointer(str(tmp_path)).save(1, make_state())
    model = make_state()["model"]
    if change == "other shapes":
        model = make_state(width=32)["model"]
        want = "of another shape or dtype (e.g. model/0.weight: saved [16, 8] float32, expected [32, 8] float32)"
    elif change == "missing keys":
        model.update({f"{i}.weight": torch.zeros(4, 4) for i in range(3, 9)})
        want = (
            "6 tensor(s) missing: 'model/3.weight', 'model/4.weight', 'model/5.weight', "
            "'model/6.weight' and 2 more"
        )
    else:
        model = {k: v.double() for k, v in model.items()}
        want = "saved [16, 8] float32, expected [16, 8] float64"
    keep = zeros_like_tree(model)
    keep = {k: v.copy_(model[k]) for k, v in keep.items()}
    with caplog.at_level(logging.INFO, logger=LOG), pytest.raises(CheckpointError) as e:
        Checkpointer(str(tmp_path)).load({"model": model})
    assert "does not fit this model" in str(e.value) and want in str(e.value)
    assert_same(keep, model)


# -- phalanx ckpt -----------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    root = str(tmp_path / "ck")
    ck = Checkpointer(root, layout={"dp": 2, "tp": 1})
    ck.save(5, make_state(seed=0))
    state = make_state(seed=1)
    ck.save(9, state)
    return root, state


def test_cli_list(saved: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = saved
    rc, out, _ = cli(capsys, "ckpt", "list", root)
    assert rc == 0
    rows = out.strip().splitlines()
    assert rows[0].split()[:3] == ["step", "size", "tensors"]
    assert rows[1].split()[0] == "5" and rows[2].split()[0] == "9" and "(latest)" in rows[2]
    rc, out, _ = cli(capsys, "ckpt", "list", f"file://{root}", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert [d["step"] for d in doc] == [5, 9] and doc[1]["latest"] and doc[0]["layout"]["dp"] == 2


def test_cli_inspect(saved: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = saved
    rc, out, _ = cli(capsys, "ckpt", "inspect", root, "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["step"] == 9 and d["steps"] == [5, 9] and d["layout"] == {"dp": 2, "tp": 1}
    assert d["tensors"]["model/0.weight"] == {"shape": [16, 8], "dtype": "float32", "nbytes": 512}
    assert d["tensors"]["optim/state/0/exp_avg"]["shape"] == [16, 8]
    assert d["nbytes"] == sum(d["files"].values())
    rc, out, _ = cli(capsys, "ckpt", "inspect", root, "--step", "5", "--verify")
    assert rc == 0
    assert "step        5" in out and "model/2.bias" in out and "verified" in out
    assert "float32" in out and "16x8" in out


def test_cli_export_safetensors_bit_exact(
    saved: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root, state = saved
    out_file = tmp_path / "out" / "model.safetensors"
    rc, out, err = cli(capsys, "ckpt", "export", root, "--format", "safetensors", str(out_file))
    assert rc == 0, err
    assert "step 9" in out
    got = load_file(str(out_file))
    assert set(got) == set(state["model"])  # HF-style names: the model/ prefix stripped
    assert_same(dict(state["model"]), got)
    rc, _, err = cli(
        capsys, "ckpt", "export", root, "--format", "safetensors", str(out_file), "--step", "5"
    )
    assert rc == 0, err
    assert_same(dict(make_state(seed=0)["model"]), load_file(str(out_file)))


def test_cli_errors(
    saved: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root, _ = saved
    cases = [
        (["list", "nosuch://x"], "URL must be a path or an fsspec URL"),
        (["list", str(tmp_path / "nothing")], "must hold at least one committed checkpoint"),
        (
            ["inspect", root, "--step", "6"],
            "--step must be a committed step: got 6, expected one of [5, 9]",
        ),
        (
            ["export", root, "--format", "onnx", "x"],
            "--format must be one of ['safetensors', 'hf']: got 'onnx'",
        ),
        (
            ["export", root, "--format", "safetensors", "x", "--prefix", "nope"],
            "must hold tensors under 'nope/'",
        ),
        (["list", root, "--storage-options", "{bad"], "--storage-options must be a JSON object"),
    ]
    for argv, want in cases:
        rc, _, err = cli(capsys, "ckpt", *argv)
        assert rc == 1 and want in err, (argv, err)
    (Path(root) / step_dir(9) / "data-r0.bin").write_bytes(b"")
    rc, _, err = cli(capsys, "ckpt", "inspect", root, "--verify")
    assert rc == 1 and "checkpoint step 9 is unusable: data-r0.bin has 0 bytes" in err
