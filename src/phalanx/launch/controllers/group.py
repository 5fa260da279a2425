"""Several controllers of one job on one etcd journal (``phalanx run --controllers
N``): the first takes the leader key and leads, the others stand by and take over
when it fails. Each is a supervised process on its own state dir (restarted when it
dies, as a single controller is: it comes back as a standby), and every replica is
given all of their URLs, comma-separated, and follows the leader.

Who calls: the launcher's thread; the interface is the one controller's
(:class:`~phalanx.launch.supervise.ControllerProcess`): ``start``, ``check``,
``url``, ``stop``, and :attr:`target`, what replicas are given.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from phalanx import env
from phalanx.launch.controllers.base import Controllers
from phalanx.launch.controllers.etcd import EtcdDown, LocalEtcd
from phalanx.launch.supervise import ControllerDown, ControllerProcess


class ControllerGroup:
    def __init__(
        self,
        run_dir: Path,
        args: list[str],
        n: int,
        *,
        local_etcd: bool = False,
        host: str | None = None,
        tls: tuple[str, str] | None = None,
    ):
        # One token for the whole group: each controller writes it to its state dir,
        # and the replicas (and the zygote that forks them, started before the
        # controllers) inherit it.
        os.environ.setdefault(env.TOKEN, secrets.token_urlsafe(32))
        self.etcd = LocalEtcd(run_dir) if local_etcd else None
        """The journal's etcd when the launcher runs it (else the config names one)."""
        self.args = args
        self.procs = [
            ControllerProcess(
                run_dir / ("controller" if i == 0 else f"controller-{i}"),
                args,
                run_dir / ("controller.log" if i == 0 else f"controller-{i}.log"),
                host=host,
                tls=tls,
            )
            for i in range(n)
        ]

    @property
    def url(self) -> str:
        """Every controller's URL, comma-separated, in the order they were started."""
        return ",".join(p.url or "" for p in self.procs)

    @property
    def restarts(self) -> int:
        """Controller processes restarted after they exited, in all."""
        return sum(p.restarts for p in self.procs)

    @property
    def target(self) -> str:
        """What replicas are given as ``--controller``: every URL (the token comes
        from the environment, ``$PHALANX_TOKEN``, shared by the whole group)."""
        return self.url

    def members(self) -> list[ControllerProcess]:
        return list(self.procs)

    def start(self) -> str:
        """Start the etcd (when the launcher runs it), then each controller in turn, the
        first as the leader; returns :attr:`url`. Raises :class:`ControllerDown`."""
        if self.etcd is not None:
            try:
                journal = self.etcd.start()
            except EtcdDown as e:
                raise ControllerDown(str(e)) from None
            for p in self.procs:
                p.args = [*self.args, f"--controller.journal={journal}"]
        for p in self.procs:
            p.start()
        return self.url

    def check(self) -> str | None:
        """Call often: restarts a controller that exited (it comes back as a standby,
        or leads if none does); returns a line per thing that happened, or None."""
        news = []
        for i, p in enumerate(self.procs):
            line = p.check()
            if line is not None:
                news.append(f"[{i}] {line}" if len(self.procs) > 1 else line)
        proc = self.etcd.proc if self.etcd is not None else None
        if self.etcd is not None and proc is not None and proc.poll() is not None:
            raise ControllerDown(
                f"the local etcd exited with {proc.returncode}; see {self.etcd.log}"
            )
        return "; ".join(news) or None

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
        if self.etcd is not None:
            self.etcd.stop()


def open_controllers(
    run_dir: Path,
    args: list[str],
    n: int = 1,
    *,
    local_etcd: bool = False,
    host: str | None = None,
    tls: tuple[str, str] | None = None,
) -> Controllers:
    """The controllers of a launcher's job, not started yet: one on ``RUN_DIR/controller``
    (its journal as the config says), or a :class:`ControllerGroup` of ``n`` (with a
    local etcd for their journal when ``local_etcd``)."""
    if n == 1 and not local_etcd:
        return ControllerProcess(
            run_dir / "controller", args, run_dir / "controller.log", host=host, tls=tls
        )
    return ControllerGroup(run_dir, args, n, local_etcd=local_etcd, host=host, tls=tls)
