"""A real Slurm cluster on one host, for the tests and ``bench/ops_slurm.py``: munged
(its own key, socket and pid file), ``slurmctld`` and four ``slurmd`` "nodes"
(:data:`NODES`), each a ``NodeName``/``Port`` pair on localhost (``slurmd -N NAME``),
all in a tmp dir, on free ports, started in the foreground (``-D``) so that we own
their pids, and stopped by those pids (never by name).

    cluster = SlurmCluster(tmp_dir)
    cluster.start()
    try:
        job = cluster.sbatch(str(edited_script(tmp_dir, (2, 2))), "job.toml", env=...)
    finally:
        cluster.stop()

The tests use it through the module-scoped fixture ``slurm`` of
``tests/integration/slurm_cluster.py``. No cgroups here:
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``. Clients find the
cluster through ``SLURM_CONF`` (:attr:`SlurmCluster.env`). :func:`missing` says why the
cluster cannot run (Slurm or munge missing, or not root: slurmd must run as root);
``make install`` installs them where it can (root and apt-get).

A node is lost (:meth:`SlurmCluster.lose_node`) by SIGKILL of its ``slurmd`` and of
its job steps: the ``slurmstepd`` processes that hold that node's log file open
(each daemonizes, so it is no child of its slurmd) and everything under them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from phalanx.net import free_port

DAEMONS = {
    name: shutil.which(name) or f"/usr/sbin/{name}" for name in ("slurmctld", "slurmd", "munged")
}
CLIENTS = ("sbatch", "scontrol", "sinfo", "squeue")
NODES = ("n1", "n2", "n3", "n4")
"""The nodes' names, each with ``NodeAddr=127.0.0.1``: the script reaches a node at
its NodeAddr (the names do not resolve here). n1 is the batch host (it holds the
batch script and the controller). Four, for a hetjob that loses a node and goes on:
the components of a hetjob cannot share a node, and Slurm (22.05,
``kill_running_job_by_node_name``) treats a node lost by one component as lost by
every component; a component of one node is then requeued (with it the whole job),
``--no-kill`` or not, and only a component of two nodes or more just drops the node.
So each component needs two nodes (policy n1, n2; rollout n3, n4)."""
SCRIPT = Path(__file__).resolve().parents[3] / "deploy" / "slurm" / "phalanx.sbatch"
"""``deploy/slurm/phalanx.sbatch`` of this checkout."""
SLURMD_TIMEOUT_S = 5
"""How long a silent slurmd takes to be marked DOWN (Slurm checks it on its own
ping cycle: in practice a few times this)."""


def missing() -> str | None:
    """Why the cluster cannot run here, or None."""
    absent = [n for n, p in DAEMONS.items() if not os.access(p, os.X_OK)]
    absent += [n for n in CLIENTS if shutil.which(n) is None]
    if absent:
        return (
            f"Slurm/munge are not installed ({', '.join(absent)} missing), so the Slurm cluster "
            f"tests cannot run: `make install` installs slurm-wlm and munge with apt-get when "
            f"run as root."
        )
    if os.geteuid() != 0:
        return "the Slurm cluster tests start slurmd, which must run as root: run them as root."
    return None


def wait_until(pred: Callable[[], object], timeout: float, what: str, every: float = 0.2) -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _tree(roots: list[int]) -> list[int]:
    kids, out, todo = _children(), [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


class SlurmCluster:
    """Who calls: one test module (the fixture), one thread."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _write_conf(self) -> None:
        ctl, *ports = (free_port() for _ in range(1 + len(NODES)))
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs=2 "
            f"Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN"
            for n, p in zip(NODES, ports, strict=True)
        )
        r = self.root
        # Slurm schedules a hetjob by backfill alone, every bf_interval (30 s by
        # default): 1 s starts one at once, as the main scheduler starts the others.
        backfill = "SchedulerParameters=bf_interval=1"
        self.conf.write_text(
            f"""ClusterName=phalanx-test
SlurmctldHost=localhost
SlurmctldPort={ctl}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/sock
CredType=cred/munge
MpiDefault=none
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
{backfill}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT_S}
SlurmctldTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=600
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _start(self, key: str, cmd: list[str]) -> None:
        with (self.root / "log" / f"{key}.out").open("ab") as f:
            self.procs[key] = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def start(self) -> None:
        r = self.root
        for d in ("munge", "munge-key", "state", "log", *(f"spool-{n}" for n in NODES)):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o755)  # clients reach the socket
        (r / "munge-key").chmod(0o700)
        key = r / "munge-key" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._write_conf()
        self._start(
            "munged",
            [
                DAEMONS["munged"],
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={r}/munge/sock",
                f"--pid-file={r}/munge/pid",
                f"--seed-file={r}/munge/seed",
                f"--log-file={r}/log/munged.log",
            ],
        )
        wait_until(lambda: (r / "munge" / "sock").exists(), 30, "munged's socket")
        self._start("slurmctld", [DAEMONS["slurmctld"], "-D", "-i", "-f", str(self.conf)])
        wait_until(lambda: self._ok("scontrol", "ping"), 60, "slurmctld to answer scontrol ping")
        for n in NODES:
            self.start_node(n)
        for n in NODES:
            self.wait_state(n, "idle")

    def _ok(self, *cmd: str) -> bool:
        return subprocess.run(cmd, env=self.env, capture_output=True, timeout=30).returncode == 0

    def run(self, *cmd: str, check: bool = True) -> str:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and r.returncode:
            raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def start_node(self, node: str) -> None:
        self._start(f"slurmd-{node}", [DAEMONS["slurmd"], "-D", "-N", node, "-f", str(self.conf)])

    def state(self, node: str) -> str:
        """The node's state as sinfo says (idle, mixed, allocated, down*, idle*, ...)."""
        return self.run("sinfo", "-h", "-n", node, "-o", "%T", check=False).strip()

    def wait_state(self, node: str, *states: str, timeout: float = 120) -> str:
        return str(
            wait_until(
                lambda: self.state(node) in states and self.state(node),
                timeout,
                f"node {node} to be {' or '.join(states)} (it is {self.state(node)!r})",
            )
        )

    def stepds(self, node: str) -> list[int]:
        """The pids of ``node``'s slurmstepd processes: those with its log file open."""
        log = str(self.root / "log" / f"slurmd-{node}.log")
        out = []
        for d in Path("/proc").iterdir():
            try:
                if not d.name.isdigit() or not (d / "cmdline").read_bytes().startswith(
                    b"slurmstepd"
                ):
                    continue
                if any(os.readlink(fd) == log for fd in (d / "fd").iterdir()):
                    out.append(int(d.name))
            except OSError:
                continue
        return out

    def lose_node(self, node: str) -> list[int]:
        """SIGKILL the node's slurmd and its job steps (stepds and all under them), as a
        node that lost power. Returns the pids killed."""
        slurmd = self.procs.pop(f"slurmd-{node}")
        pids = _tree([slurmd.pid, *self.stepds(node)])
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        slurmd.wait(timeout=30)
        return pids

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit; returns the job id."""
        r = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
        )
        if r.returncode:
            raise AssertionError(f"sbatch exited {r.returncode}: {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def submit(
        self,
        work: Path,
        config: Path,
        *overrides: str,
        groups: tuple[int, ...],
        env: dict[str, str],
    ) -> tuple[str, Path]:
        """``sbatch`` of :func:`edited_script` (``groups``) on ``config`` and its
        ``--section.key=VALUE`` ``overrides``, from ``work``: phalanx and Python are this
        interpreter's, the controller on a free port, the job dir ``work/job`` and the
        script's output ``work/slurm-JOB.out``. ``env``: the job's environment (its
        ``PYTHONPATH``, say). Returns (job id, job dir)."""
        job_dir = work / "job"
        env = {
            **env,
            "PHALANX_BIN": str(Path(sys.executable).parent / "phalanx"),
            "PHALANX_PYTHON": sys.executable,
            "PHALANX_JOB_DIR": str(job_dir),
            "PHALANX_PORT": str(free_port()),
        }
        script = edited_script(work, groups)
        out = f"--output={work}/slurm-%j.out"
        return self.sbatch(out, str(script), str(config), *overrides, env=env, cwd=work), job_dir

    def job_state(self, job: str) -> str:
        out = self.run("scontrol", "show", "job", job, check=False)
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return ""

    def wait_job(self, job: str, timeout: float) -> str:
        """Wait until the job has ended; returns its final state (COMPLETED, FAILED...)."""
        done = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        return str(
            wait_until(
                lambda: self.job_state(job) in done and self.job_state(job),
                timeout,
                f"job {job} to end (it is {self.job_state(job)!r})",
                every=0.5,
            )
        )

    def stop(self) -> None:
        for out in self.run("squeue", "-h", "-o", "%i", check=False).split():
            self.run("scancel", out, check=False)
        for key in reversed(list(self.procs)):
            p = self.procs[key]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for n in NODES:  # steps left behind by a slurmd that went first
            for pid in _tree(self.stepds(n)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def edited_script(tmp: Path, groups: tuple[int, ...]) -> Path:
    """``phalanx.sbatch`` with its resources edited to this cluster, as its header tells
    a user to: ``groups`` holds each component's node count, ``(2,)`` for a job without
    rollout replicas (the hetjob lines deleted) and ``(2, 2)`` for an RL job that may
    lose a node (see :data:`NODES`). Written to ``tmp``."""
    text = SCRIPT.read_text()
    start, end = text.index("## group 0"), text.index("\nset -uo pipefail")
    group = "#SBATCH --nodes={}\n#SBATCH --ntasks-per-node=1\n#SBATCH --exclusive\n"
    group += "#SBATCH --no-kill\n"
    out = tmp / "phalanx.sbatch"
    out.write_text(text[:start] + "#SBATCH hetjob\n".join(map(group.format, groups)) + text[end:])
    return out


def steps_seen(job_dir: Path) -> list[int]:
    """The steps a Slurm job's replicas have printed as committed so far (their agents'
    workers' lines, ``agent-NAME[.K]/genG/rank0.out``)."""
    out = []
    for f in job_dir.glob("agent-*/gen*/rank0.out"):
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"event": "step"' in line:
                try:
                    out.append(int(json.loads(line)["step"]))
                except (ValueError, KeyError):
                    continue
    return out
