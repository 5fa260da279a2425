"""Universal checkpoints reshard on load: real torchrun-style processes, gloo
on CPU, the tensor-parallel model of :mod:`phalanx.train.tp`.

Each launch is a group of rank processes that rendezvous through a TCPStore
hosted here on an OS-picked port (``TORCHELASTIC_USE_AGENT_STORE``, as under
torchrun), so no port is guessed. Ranks report through safetensors dumps and
JSON lines: nothing is pickled across processes.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from procs import PROGRESS_S, Procs, child_env, signal_group, wait_for

from phalanx.checkpoint import Checkpointer, CheckpointStore
from phalanx.train import tp, tp_state
from phalanx.train.snapshot import load_state

WORKER = Path(__file__).with_name("reshard_worker.py")
TP_WORKER = ["-m", "phalanx.jobs.tp_worker"]


class Launch:
    """``n`` rank processes of one job, started like torchrun starts them."""

    def __init__(self, procs: Procs, n: int, args: list[str], label: str):
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.ranks: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
        for r in range(n):
            env = child_env() | {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "OMP_NUM_THREADS": "1",
            }
            out = procs.workdir / f"{label}.r{r}.out"
            err = procs.workdir / f"{label}.r{r}.err"
            with out.open("wb") as fo, err.open("wb") as fe:
                p = subprocess.Popen(
                    [sys.executable, *args],
                    stdout=fo,
                    stderr=fe,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            procs.started.append(p)  # killed by process group at teardown
            self.ranks.append((p, out, err))

    def wait(self, timeout: float = 90.0) -> None:
        """Every rank exits 0 within ``timeout`` s; else fail with their stderr."""
        for r, (p, _, _) in enumerate(self.ranks):
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                tails = "\n".join(
                    f"--- rank {i}:\n{e.read_text()[-2000:]}"
                    for i, (_, _, e) in enumerate(self.ranks)
                )
                raise AssertionError(f"rank {r} of {len(self.ranks)} ended with {rc}:\n{tails}")

    def lines(self) -> list[dict[str, Any]]:
        """Rank 0's complete JSON lines so far."""
        complete = self.ranks[0][1].read_text().split("\n")[:-1]
        return [json.loads(x) for x in complete if x.startswith("{")]

    def signal(self, sig: int) -> None:
        for p, _, _ in self.ranks:
            signal_group(p, sig)


def reshard_run(procs: Procs, dp: int, tp: int, label: str, *args: str) -> None:
    Launch(procs, dp * tp, [str(WORKER), "--dp", str(dp), "--tp", str(tp), *args], label).wait()


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two state trees are not bit-identical (tensors: dtype, shape, bits)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return [f"{path}: tensor vs {type(b).__name__}"]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return [f"{path}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"]
        if not torch.equal(a, b):
            return [f"{path}: max |diff| {(a - b).abs().max().item():.3g}"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only on one side" for k in sorted(set(a) ^ set(b), key=str)]
        return out + [d for k in a if k in b for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}/{i}")
        ]
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} != {b!r}"]


def assert_same_state(saved: Path, loaded: Path) -> dict[str, Any]:
    """The state a run loaded is bit-identical to the state the saving run had
    (model, optimizer moments and steps, param_groups, step), and computes
    the same function up to float reduction order. Returns the loaded dump."""
    a, b = load_state(saved), load_state(loaded)
    assert a["layout"] != b["layout"], "a reshard test must change the layout"
    diff = differences(
        {k: v for k, v in a.items() if k not in ("layout", "eval_loss")},
        {k: v for k, v in b.items() if k not in ("layout", "eval_loss")},
    )
    assert not diff, f"{a['layout']} -> {b['layout']}: {len(diff)} differences: {diff[:8]}"
    assert math.isclose(a["eval_loss"], b["eval_loss"], rel_tol=1e-12), (a, b)
    return b


def chunk_rows(ckpt: Path, key: str) -> list[tuple[int, int]]:
    """(row offset, rows) of each saved chunk of ``key`` in the latest checkpoint."""
    step = CheckpointStore(f"file://{ckpt}").latest()
    meta = json.loads((ckpt / f"step-{step:09d}" / ".metadata").read_text())
    chunks = meta["state_dict"][key]["chunks"]
    return sorted((offsets[0], sizes[0]) for offsets, sizes in chunks)


# Four launches in a row (16 processes); a hung collective still fails each rank
# after its 60 s timeout.
def test_reshard_bit_exact_2_to_8_to_2_and_uneven_tp4(tmp_path: Path, procs: Procs) -> None:
    """2 ranks (dp 2 x tp 1) train and save; 8 ranks (dp 4 x tp 2) load it
    bit-exact, train on and save; 2 ranks (dp 2 x tp 1) load that bit-exact; 4
    ranks (dp 1 x tp 4) load it bit-exact too, into uneven shards (MLP 66 rows
    and vocab 30 over TP 4) and the fused QKV split per head, and save it so."""
    a, b, c = (f"file://{tmp_path}/ckpt-{x}" for x in "abc")
    reshard_run(procs, 2, 1, "s", "--train", "3", "--save", a, "--dump", str(tmp_path / "s.st"))
    reshard_run(procs, 4, 2, "m", "--load", a, "--dump-loaded", str(tmp_path / "m0.st"),
                "--train", "2", "--save", b, "--dump", str(tmp_path / "m.st"))  # fmt: skip
    reshard_run(procs, 2, 1, "e", "--load", b, "--dump-loaded", str(tmp_path / "e0.st"))
    reshard_run(procs, 1, 4, "u", "--load", b, "--dump-loaded", str(tmp_path / "u0.st"),
                "--save", c)  # fmt: skip

    m0 = assert_same_state(tmp_path / "s.st", tmp_path / "m0.st")  # 2 -> 8
    e0 = assert_same_state(tmp_path / "m.st", tmp_path / "e0.st")  # 8 -> 2
    u0 = assert_same_state(tmp_path / "m.st", tmp_path / "u0.st")  # 8 -> 4, uneven
    assert (m0["step"], e0["step"], u0["step"]) == (3, 5, 5)
    assert differences(m0["model"], e0["model"]), "the 8-rank run must have trained"
    optim = e0["optim"]
    assert optim["state"]["blocks.0.attn.qkv.k"]["step"] == 5.0
    assert optim["state"]["blocks.0.attn.qkv.k"]["exp_avg_sq"].abs().sum() > 0
    assert [g["weight_decay"] for g in optim["param_groups"]] == [0.1, 0.0]
    assert "blocks.1.attn.qkv.v" in optim["param_groups"][0]["params"]

    # The 8-rank run trained like one process does from the same state: DP
    # gradients averaged and TP shards used right, up to float reduction order.
    cfg = tp.TPConfig()
    model = tp.build_model(cfg, None)
    opt = tp.make_optimizer(model)
    tp_state.load_model_state(model, m0["model"])
    tp_state.load_optim_state(model, opt, m0["optim"])
    for step in (4, 5):
        tp.train_step(model, opt, tp.batch_for_step(cfg, step, 8))
    for key, t in tp_state.gathered_state(model)["model"].items():
        torch.testing.assert_close(e0["model"][key], t, rtol=1e-8, atol=1e-10, msg=key)

    # Each checkpoint really is sharded by logical tensor as its layout says:
    # TP 2 evenly, TP 4 unevenly.
    up, v = "model/blocks.0.mlp.up.weight", "optim/state/blocks.1.attn.qkv.v/exp_avg"
    ckpt_b, ckpt_c = tmp_path / "ckpt-b", tmp_path / "ckpt-c"
    assert chunk_rows(ckpt_b, up) == [(0, 33), (33, 33)]
    assert chunk_rows(ckpt_c, up) == [(0, 17), (17, 17), (34, 17), (51, 15)]
    assert chunk_rows(ckpt_c, v) == [(0, 6), (6, 6), (12, 6), (18, 6)]
    assert chunk_rows(ckpt_c, "model/head.weight") == [(0, 8), (8, 8), (16, 8), (24, 6)]
    for ckpt, world, layout in ((ckpt_b, 8, {"dp": 4, "tp": 2}), (ckpt_c, 4, {"dp": 1, "tp": 4})):
        manifest = json.loads(next(ckpt.glob("step-*/phalanx.json")).read_text())
        assert (manifest["world_size"], manifest["layout"]) == (world, layout)


def test_worker_sigterm_checkpoints_and_resumes_on_one_rank(tmp_path: Path, procs: Procs) -> None:
    """The tp_worker on 2 ranks (TP 2) gets SIGTERM, checkpoints the step it
    stopped at and exits 0; restarted on 1 rank it reshard-loads and goes on
    from the next step, with the losses of an uninterrupted 1-rank run (up to
    float reduction order)."""
    ckpt = f"file://{tmp_path}/ckpt"
    common = ["--save-every", "4", "--step-delay", "0.01"]
    first = Launch(procs, 2, [*TP_WORKER, "--ckpt", ckpt, "--steps", "100000", *common], "w2")
    wait_for(lambda: len(first.lines()) >= 6, PROGRESS_S, "the 2-rank worker to reach step 6")
    first.signal(signal.SIGTERM)
    first.wait()
    lines = first.lines()
    done = lines[-1]
    stop = done["step"]
    assert (done["event"], done["reason"], done["checkpoint"]) == ("done", "sigterm", stop)
    assert [x["step"] for x in lines[:-1]] == list(range(1, stop + 1))
    assert CheckpointStore(ckpt).latest() == stop

    out = ["--out", str(tmp_path / "resumed.st")]
    resumed = Launch(
        procs, 1, [*TP_WORKER, "--ckpt", ckpt, "--steps", str(stop + 3), *common, *out], "w1"
    )
    # Meanwhile, the uninterrupted run on one rank, in this process: no
    # torch.distributed at all with one rank, like the worker's.
    cfg = tp.TPConfig()
    model = tp.build_model(cfg, None)
    opt = tp.make_optimizer(model)
    ref = {s: tp.train_step(model, opt, tp.batch_for_step(cfg, s, 8)) for s in range(1, stop + 4)}
    resumed.wait()
    after = resumed.lines()
    assert [x["step"] for x in after[:-1]] == [stop + 1, stop + 2, stop + 3]
    assert all(x["world"] == 1 and x["resumed_from"] == stop for x in after)
    assert after[-1]["reason"] == "finished"

    for x in lines[:-1] + after[:-1]:
        assert math.isclose(x["loss"], ref[x["step"]], rel_tol=1e-9), (x, ref[x["step"]])
    got = load_state(tmp_path / "resumed.st")["model"]
    for key, t in tp_state.gathered_state(model)["model"].items():
        torch.testing.assert_close(got[key], t, rtol=1e-8, atol=1e-10, msg=key)


def test_full_state_loads_without_template_in_one_process(tmp_path: Path) -> None:
    """No torch.distributed (TP 1, one process): a checkpoint loaded without a
    template comes back as full tensors and JSON, which load_model_state and
    load_optim_state put back exactly (the next step is bit-identical); a
    tensor of the wrong shape is refused, naming its key."""
    cfg = tp.TPConfig()
    model = tp.build_model(cfg, None)
    opt = tp.make_optimizer(model)
    for s in (1, 2):
        tp.train_step(model, opt, tp.batch_for_step(cfg, s, 8))
    ck = Checkpointer(f"file://{tmp_path}/ckpt")
    ck.save(2, {"model": tp_state.model_state(model), "optim": tp_state.optim_state(model, opt)})
    res = ck.load()
    ck.close()
    assert res is not None and res.step == 2

    fresh = tp.build_model(cfg, None)
    fresh_opt = tp.make_optimizer(fresh)
    tp_state.load_model_state(fresh, res.state["model"])
    tp_state.load_optim_state(fresh, fresh_opt, res.state["optim"])
    diff = differences(
        tp_state.gathered_state(model, opt), tp_state.gathered_state(fresh, fresh_opt)
    )
    assert not diff, diff[:8]
    batch = tp.batch_for_step(cfg, 3, 8)
    assert tp.train_step(fresh, fresh_opt, batch) == tp.train_step(model, opt, batch)
    assert not differences(
        tp_state.gathered_state(model, opt), tp_state.gathered_state(fresh, fresh_opt)
    )

    bad = dict(res.state["model"])
    bad["blocks.0.attn.qkv.q"] = torch.zeros(3, cfg.d_model, dtype=cfg.dtype)
    with pytest.raises(ValueError, match=r"'blocks.0.attn.qkv.q' must have the model's shape"):
        tp_state.load_model_state(fresh, bad)
