"""Harness for the FT data-parallel integration tests: a real controller and real
``phalanx replica`` processes of the built-in job, each in its own session (so
that SIGKILL/SIGSTOP reach the whole process group), with stdout read line by
line on a thread per process.

Every process is started through :class:`FTJob`, which kills each one's
process group (by pid, never by name) in :meth:`FTJob.cleanup`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import procs
import torch
from procs import write_job_toml

WAIT_S = procs.PROGRESS_S
"""Bound on any single wait; a healthy run hits none of them. A wait ends at its
event: this only caps a hang, and it must outlast the start of several torch
processes on a busy 2-core machine (60 s did not: a replica of 2 ranks beside
another, a warm spare and a CPU hog took longer to commit its third step)."""

TIMEOUTS = {
    "collective_s": 1.0,
    "heartbeat_s": 2.0,
    "heartbeat_interval_s": 0.2,
    "suspect_grace_s": 0.25,
    "quorum_s": 30.0,
}

TRAIN = {
    "steps": 40,
    "dtype": "float64",
    "in_dim": 8,
    "hidden": [32],
    "out_dim": 2,
    "dataset_size": 512,
    "global_batch_size": 24,
    "micro_batch_size": 4,
    "optimizer": "adamw",
    "lr": 0.01,
    "weight_decay": 0.01,
    "log_samples": True,
}
"""Small float64 MLP; 24 samples split over 1..4 replicas in micro-batches of 4,
so that accumulation runs and AdamW carries optimizer state. ``step_delay_s``
(per micro-batch) is set per test: it paces training so that a test can act
between steps; it does not change the numbers."""


def write_job(
    path: Path,
    *,
    train: dict[str, Any] | None = None,
    policy: dict[str, Any] | None = None,
    timeouts: dict[str, Any] | None = None,
    job_id: str = "ftddp",
    ranks: int = 1,
) -> Path:
    """Write a job TOML: :data:`TRAIN` and :data:`TIMEOUTS` with overrides, and
    ``ranks`` processes per replica."""
    sections = {
        "job": {"id": job_id, "seed": 7},
        "timeouts": {**TIMEOUTS, **(timeouts or {})},
        "controller": {"tick_s": 0.02},
        "roles.policy": {"min_replicas": 1, "n_init_replicas": 1, "join_timeout_s": 0.5}
        | (policy or {}),
        "train": {**TRAIN, **(train or {})},
        "replica": {"ranks": ranks},
    }
    return write_job_toml(path, sections)


def child_env() -> dict[str, str]:
    e = procs.child_env()
    e["OMP_NUM_THREADS"] = "1"
    return e


class Proc:
    """One child process. JSON lines on stdout are collected in :attr:`events`
    (with the arrival time under ``"_at"``); other lines in :attr:`text`. Stdout is
    also copied to ``LABEL.out`` and stderr goes to ``LABEL.err``, for post-mortems."""

    def __init__(
        self,
        args: list[str],
        label: str,
        workdir: Path,
        stdin: int = subprocess.DEVNULL,
        host: Any = None,
        env: dict[str, str] | None = None,
    ):
        """``host``: a :class:`netns.Host` to run on (its namespace, and its address
        advertised to peers); None: this machine, over loopback. ``env``: variables
        set for this process on top of the tests' environment."""
        self.label = label
        self.host = host
        env = {**child_env(), **(env or {})}
        if host is not None:
            args = host.wrap(args)
            env["PHALANX_ADVERTISE_HOST"] = host.ip
        self.err_path = workdir / f"{label}.err"
        self.out_path = workdir / f"{label}.out"
        with self.err_path.open("wb") as err:
            self.popen = subprocess.Popen(
                args,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=stdin,
                env=env,
                start_new_session=True,
            )
        self.events: list[dict[str, Any]] = []
        self.text: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, name=f"read-{label}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with self.out_path.open("wb") as copy:
            for raw in self.popen.stdout:
                copy.write(raw)
                copy.flush()
                self._parse(raw.decode(errors="replace").rstrip("\n"))
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _parse(self, line: str) -> None:
        with self._cond:
            if line.startswith("{"):
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    self.text.append(line)
                else:
                    ev["_at"] = time.monotonic()
                    self.events.append(ev)
            else:
                self.text.append(line)
            self._cond.notify_all()

    def stderr_tail(self, n: int = 4000) -> str:
        try:
            return self.err_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_for(self, pred: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
        """Wait until ``pred()`` (called under this process's lock, re-run at each
        new stdout line) is truthy; return its value. Fails on timeout or EOF."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = pred()
                if value:
                    return value
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    why = "it exited" if self._eof else f"{timeout} s passed"
                    raise AssertionError(
                        f"{self.label}: waiting for {what}, but {why} "
                        f"(rc={self.popen.poll()})\n--- stderr tail ---\n{self.stderr_tail()}"
                    )
                self._cond.wait(min(left, 0.5))

    def wait_event(
        self, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = WAIT_S
    ) -> dict[str, Any]:
        """Wait for a JSON event satisfying ``pred``; return it."""
        return self.wait_for(lambda: next((e for e in self.events if pred(e)), None), what, timeout)

    def wait_step(self, step: int, timeout: float = WAIT_S) -> dict[str, Any]:
        return self.wait_event(
            lambda e: e["event"] == "step" and e["step"] >= step, f"step {step}", timeout
        )

    def steps(self) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self.events if e["event"] == "step"]

    def signal(self, sig: int) -> None:
        """Send ``sig`` to this process's group (it leads its own session)."""
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)
        self._reader.join(timeout=10)


SPARE = (
    "import runpy, sys, torch, torch._dynamo, phalanx.jobs.ft_ddp; "
    "sys.stdin.readline(); "
    "runpy.run_module('phalanx.cli', run_name='__main__', alter_sys=True)"
)
"""A warm spare: pays the imports (torch, and the torch._dynamo import that the
first optimizer triggers: seconds on a loaded 2-core machine) up front, then
waits for a line on stdin and runs ``phalanx.cli`` exactly as ``python -m
phalanx.cli ARGS`` would. It touches neither the network nor the controller
before it is released."""


def gated_spare(loop: str) -> str:
    """:data:`SPARE` for each rank of a replica of several ranks (``loop``: the job
    module it imports ahead): the ranks share their launcher's stdin, so they wait
    for a file (``argv[1]``, named per replica) instead."""
    return (
        f"import os, runpy, sys, time, torch, torch._dynamo, {loop}\n"
        "gate = sys.argv.pop(1)\n"
        "while not os.path.exists(gate):\n"
        "    time.sleep(0.02)\n"
        "runpy.run_module('phalanx.cli', run_name='__main__', alter_sys=True)\n"
    )


GATED_SPARE = gated_spare("phalanx.jobs.ft_hsdp")


class Replica(Proc):
    """A ``phalanx replica`` process (or a warm spare that will become one)."""

    def __init__(
        self,
        args: list[str],
        label: str,
        workdir: Path,
        name: str,
        out: Path,
        spare: bool,
        host: Any = None,
        env: dict[str, str] | None = None,
    ):
        stdin = subprocess.PIPE if spare else subprocess.DEVNULL
        super().__init__(args, label, workdir, stdin, host=host, env=env)
        self.name = name
        self.out = out
        self.waiting = spare

    gate: Path | None = None
    """A gated spare's release file (see :data:`GATED_SPARE`)."""

    def release(self) -> None:
        """Start a warm spare's replica (see :data:`SPARE`)."""
        if self.gate is not None:
            assert self.waiting, f"{self.label} is not a spare"
            self.gate.touch()
            self.waiting = False
            return
        assert self.waiting and self.popen.stdin is not None, f"{self.label} is not a spare"
        self.popen.stdin.write(b"go\n")
        self.popen.stdin.close()
        self.waiting = False

    @property
    def done(self) -> bool:
        with self._cond:
            return any(e["event"] == "done" for e in self.events)

    def finish(self, timeout: float = WAIT_S) -> dict[str, Any]:
        """Wait for the ``done`` line and return the final state, which is written
        just before it. The exit itself (seconds of interpreter teardown after
        torch._dynamo was imported) is not waited for here; :meth:`FTJob.cleanup`
        checks the exit status."""
        self.wait_event(lambda e: e["event"] == "done", "the done line", timeout)
        return load_state(self.out)


class FTJob:
    """A controller on a fresh state dir under ``workdir``, plus replicas."""

    def __init__(self, workdir: Path, config: Path):
        self.workdir = workdir
        self.config = config
        self.state_dir = workdir / "state"
        self.procs: list[Proc] = []
        self.controller: Proc | None = None
        self._n = 0

    def _label(self, what: str) -> str:
        self._n += 1
        return f"{self._n:02d}-{what}"

    def start_controller(self, host: Any = None, bind: str | None = None) -> Proc:
        """Start (or restart, on the same state dir) the controller on port 0 and
        wait until it announces its URL. ``host``: a :class:`netns.Host` to run on;
        ``bind``: the address to bind (default: loopback, or the host's address)."""
        args = [sys.executable, "-m", "phalanx.cli", "controller", "--config", str(self.config)]
        args += ["--state-dir", str(self.state_dir), "--port", "0"]
        if bind or host is not None:
            args += ["--host", bind or host.ip]
        p = Proc(args, self._label("controller"), self.workdir, host=host)
        self.procs.append(p)
        p.wait_for(
            lambda: any(re.search(r" at https?://\S+", t) for t in p.text),
            "the controller to announce its URL",
        )
        self.controller = p
        return p

    def status(self) -> dict[str, Any]:
        """The controller's ``/v1/status``."""
        import httpx

        url = (self.state_dir / "url").read_text().strip()
        token = (self.state_dir / "token").read_text().strip()
        r = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        r.raise_for_status()
        return r.json()

    def start_replica(
        self,
        name: str,
        *overrides: str,
        spare: bool = False,
        ranks: int = 1,
        host: Any = None,
        env: dict[str, str] | None = None,
    ) -> Replica:
        """Start ``python -m phalanx.cli replica --name NAME`` (extra args are dotted
        config overrides); its final state goes to ``LABEL.safetensors``. With
        ``spare=True`` the process starts as a warm spare and the replica runs
        only at :meth:`Replica.release`. With ``ranks > 1`` the replica's ranks are
        started by ``phalanx.launch.ranks`` (the process is that launcher; its
        ranks share its process group)."""
        label = self._label(f"replica-{name}")
        out = self.workdir / f"{label}.safetensors"
        cli = ["replica", "--config", str(self.config), "--controller", str(self.state_dir)]
        cli += ["--name", name, "--out", str(out), *overrides]
        head = ["-c", SPARE] if spare else ["-m", "phalanx.cli"]
        gate = self.workdir / f"{label}.go"
        if ranks > 1:
            rank = ["-c", GATED_SPARE, str(gate)] if spare else head
            head = [
                "-m",
                "phalanx.launch.ranks",
                "--nproc",
                str(ranks),
                "--",
                sys.executable,
                *rank,
            ]
        r = Replica(
            [sys.executable, *head, *cli],
            label,
            self.workdir,
            name,
            out,
            spare and ranks == 1,
            host=host,
            env=env,
        )
        if spare and ranks > 1:
            r.gate, r.waiting = gate, True
        self.procs.append(r)
        return r

    def cleanup(self, exit_grace_s: float = 0.0) -> None:
        """Kill every process's group. Replicas that printed ``done`` must not have
        exited with an error: they get ``exit_grace_s`` to finish exiting, and those
        that have exited by then are judged."""
        deadline = time.monotonic() + exit_grace_s
        bad = []
        for p in self.procs:
            if isinstance(p, Replica) and p.done:
                try:
                    p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                if p.popen.poll() not in (None, 0):
                    bad.append(f"{p.label} exited with {p.popen.poll()}:\n{p.stderr_tail()}")
        for p in self.procs:
            if p.popen.poll() is None:
                p.signal(signal.SIGKILL)  # reaches a SIGSTOPped group too
        for p in self.procs:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            p._reader.join(timeout=5)
            for f in (p.popen.stdin, p.popen.stdout):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        assert not bad, "\n".join(bad)


# -- replicas of several ranks (HSDP) ------------------------------------------

HELD_TIMEOUTS = {"heartbeat_s": 30.0, "suspect_grace_s": 1.0, "quorum_s": 60.0}
HELD_POLICY = {"n_init_replicas": 2, "join_timeout_s": 30.0}
"""For the failure tests. A failed replica is found by the survivor's failed
collective (and a probe it cannot answer), so these do not slow its eviction.
They let the test hold the survivor (SIGSTOP) while the failed replica comes
back, which takes seconds on a loaded 2-core machine: the survivor is not taken
for dead meanwhile, and the returning replica's quorum waits for it instead of
starting alone from an old step."""


@contextlib.contextmanager
def held(p: Replica) -> Iterator[None]:
    """``p``'s process group stopped (SIGSTOP) for the duration."""
    p.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        p.signal(signal.SIGCONT)


def wait_registered(job: FTJob, name: str, other_than: str) -> str:
    """Wait until the controller lists a replica ``name`` whose id is not ``other_than``
    (a new incarnation); return its id."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for m in job.status()["roles"]["policy"]["replicas"]:
            rid = m["replica_id"]
            if rid.split(":")[0] == name and rid != other_than:
                return str(rid)
        time.sleep(0.1)
    raise AssertionError(f"no new incarnation of {name} registered in {WAIT_S} s")


def kill_a_rank_and_heal(
    job: FTJob, survivor: Replica, victim: Replica, spare: Replica, at: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """SIGKILL rank 1 of ``victim`` (a replica of several ranks) at its step ``at``:
    the replica fails whole and ``survivor`` commits alone; then ``spare`` (the
    victim's restart, warm: a cold start of several ranks takes longer on a loaded
    2-core machine than the survivor needs to finish) is released while the
    survivor is held, and heals shard by shard. Returns the survivor's first step
    alone and the restart's first (healed) step."""
    from phalanx.launch.ranks import rank_pids

    victim.wait_step(at)
    os.kill(rank_pids(victim.popen.pid)[1], signal.SIGKILL)
    # The other rank fails on its own (its next collective inside the replica) or is
    # stopped by the launcher, which exits with a failing status either way.
    assert victim.popen.wait(timeout=60) != 0
    gone = survivor.wait_event(
        lambda e: e["event"] == "step" and e["participants"] == 1, "a step alone"
    )
    with held(survivor):
        spare.release()
        wait_registered(job, victim.name, other_than=gone["replica"])
    healed = spare.wait_event(lambda e: e["event"] == "step" and e["healed"], "the heal")
    return gone, healed


def cleanup_jobs(jobs: list[FTJob], exit_grace_s: float = 0.0) -> None:
    """Clean up every job even if one's check fails; then raise the first failure."""
    errors = []
    for j in jobs:
        try:
            j.cleanup(exit_grace_s)
        except AssertionError as e:
            errors.append(e)
    if errors:
        raise errors[0]


# -- checks -----------------------------------------------------------------


def load_state(path: Path) -> dict[str, Any]:
    """A replica's final ``--out`` file: tensors plus ``__meta__`` (step, cursor)."""
    from safetensors import safe_open

    out: dict[str, Any] = {}
    with safe_open(str(path), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            out[k] = f.get_tensor(k)
        out["__meta__"] = dict(f.metadata() or {})
    return out


def assert_identical(states: list[dict[str, Any]]) -> None:
    """Every state has the same keys, metadata and bit-identical tensors."""
    first = states[0]
    for i, st in enumerate(states[1:], 1):
        assert st.keys() == first.keys(), (i, sorted(st.keys() ^ first.keys()))
        assert st["__meta__"] == first["__meta__"], (i, st["__meta__"], first["__meta__"])
        for k, v in first.items():
            if k == "__meta__":
                continue
            assert st[k].dtype == v.dtype and st[k].shape == v.shape, (i, k)
            assert torch.equal(st[k], v), f"state {i} differs at {k}: {max_diff(st[k], v)}"


def assert_same_files(replicas: list[Replica], step: int) -> None:
    """The final files of one job are byte-identical, at its last step ``step``: the
    job's output must not depend on which replica's file a user takes (issue 34).
    Every replica that said ``done`` without ``finished_elsewhere`` wrote one."""
    wrote = [
        r
        for r in replicas
        if any(e["event"] == "done" and not e.get("finished_elsewhere") for e in r.events)
    ]
    assert wrote, "no replica wrote a final file"
    blobs = {r.out.read_bytes() for r in wrote}
    assert len(blobs) == 1, f"{len(blobs)} different final files among {len(wrote)}"
    assert load_state(wrote[0].out)["__meta__"]["step"] == str(step)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def assert_close(got: dict[str, Any], want: dict[str, Any], atol: float = 1e-9) -> float:
    """Same keys and metadata; every tensor within ``atol``. Returns the largest difference."""
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    assert got["__meta__"] == want["__meta__"], (got["__meta__"], want["__meta__"])
    worst = 0.0
    for k, v in want.items():
        if k == "__meta__":
            continue
        d = max_diff(got[k], v)
        assert d <= atol, f"{k} differs from the reference by {d:.3g} > {atol}"
        worst = max(worst, d)
    return worst


def step_lines(replicas: list[Proc]) -> dict[int, dict[str, dict[str, Any]]]:
    """Committed-step lines of every replica process, by step, then by replica id
    (``name:incarnation``), for the tests' own figures (losses, participants); the
    checks are the product audit's (:func:`audit_job`)."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for r in replicas:
        for e in r.steps():
            out.setdefault(e["step"], {})[e["replica"]] = e
    return out


MUST_PASS = ("steps.once", "steps.order", "steps.complete")


def audit_job(
    job: FTJob, steps: int | None, samples: bool = True, dataset_size: int | None = None
) -> Any:
    """The product audit (``phalanx audit --state-dir``) of ``job``: its controller's
    state dir and the stdout of every replica process that printed a line
    (:func:`audit_outputs`). Returns the audited :class:`phalanx.audit.Run`."""
    logs = [
        p.out_path
        for p in job.procs
        if isinstance(p, Replica) and any(e.get("replica") for e in p.events)
    ]
    return audit_outputs(job.state_dir, logs, steps, samples, dataset_size)


def audit_outputs(
    state_dir: Path,
    logs: list[Path],
    steps: int | None,
    samples: bool = True,
    dataset_size: int | None = None,
) -> Any:
    """The product audit of the job of the controller state dir ``state_dir`` from its
    replicas' outputs ``logs``: every check passes (none is a violation); the steps'
    checks and, with ``samples``, ``data.samples`` must have run. Beyond it, as the
    tests always asked: the job committed steps up to ``steps``, every participant of
    a step printed it (the audit allows a replica killed between its commit and its
    line; these tests' kills never land there), and the samplers read a dataset of
    ``dataset_size`` when given (the audit takes it from the lines). ``steps`` None: a
    job stopped mid-run, whose last step and last lines are the kill's. Returns the
    audited :class:`phalanx.audit.Run`."""
    from phalanx.audit import audit_checks, load_job

    run = load_job(state_dir, logs)
    checks = {c.name: c for c in audit_checks(run)}
    bad = [f"{c.name}: {c.detail}" for c in checks.values() if c.verdict == "FAIL"]
    assert not bad, "the audit found violations:\n" + "\n".join(bad)
    for name in (*MUST_PASS, *(("data.samples",) if samples else ())):
        assert checks[name].verdict == "pass", f"{name} did not run: {checks[name].detail}"
    if dataset_size is not None:
        sizes = {e.get("dataset_size") for e in run.steps()}
        assert sizes == {dataset_size}, f"the samplers' dataset sizes {sizes}, not {dataset_size}"
    if steps is None:
        return run
    got = {e["step"] for e in run.steps()}
    assert max(got) == steps, f"the job's last step is {max(got)}, expected {steps}"
    printed: dict[tuple[int, int], tuple[int, set[str]]] = {}
    for e in run.steps():
        printed.setdefault((e["quorum_id"], e["step"]), (e["participants"], set()))[1].add(
            e["replica"]
        )
    for (_, step), (parts, ids) in sorted(printed.items()):
        assert len(ids) == parts, f"step {step}: {parts} participants but {len(ids)} printed it"
    return run
