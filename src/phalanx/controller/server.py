"""Start a controller: check and lock the state dir, load the token and the journal,
bind, publish the URL, serve.

The state dir (:mod:`phalanx.controller.statedir`) holds everything the controller
needs to come back after a SIGKILL. Restarted with ``--port 0``, a controller first
tries the port it had before, so replicas that only know the URL re-attach by
themselves; if that port is taken it picks a new one and rewrites ``url``.

Given a certificate and key it serves HTTPS, and ``url`` says ``https://``; the
URL names the address clients should use (:func:`phalanx.controller.tls.url_for`),
never a wildcard such as ``0.0.0.0``.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from phalanx.config import JobConfig
from phalanx.controller.statedir import (
    CONFIG,
    JOURNAL,
    PAYLOADS,
    URL_FILE,
    CannotStart,
    check_journal,
    load_or_create_token,
    prepare,
    write_private,
)
from phalanx.controller.tls import check_tls, is_loopback, url_for, warn_if_clear_text


def _bind(host: str, port: int, state_dir: Path) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    candidates = [port]
    if port == 0 and (state_dir / URL_FILE).exists():
        previous = urlsplit((state_dir / URL_FILE).read_text().strip()).port
        if previous:
            candidates.insert(0, previous)
    err: OSError | None = None
    for p in candidates:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            raise CannotStart(f"--host {host!r} cannot be bound: {e.strerror or e}.") from None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, p))
        except OSError as e:
            sock.close()
            err = e
            continue
        sock.listen(2048)
        sock.set_inheritable(True)
        return sock
    if isinstance(err, socket.gaierror) or (err is not None and err.errno == errno.EADDRNOTAVAIL):
        raise CannotStart(
            f"--host {host!r} must be an address of this machine: {err.strerror or err}. Use "
            f"127.0.0.1, 0.0.0.0 (every interface) or one of this host's addresses."
        )
    if err is not None and err.errno == errno.EADDRINUSE:
        raise CannotStart(
            f"--port {port} must be free on {host}: it is in use. Pick a free --port or use "
            f"--port 0 (any free port)."
        )
    raise CannotStart(f"controller could not bind {host}:{port}: {err}.")


def url_of(sock: socket.socket, tls: bool = False) -> str:
    """The URL clients use for the controller listening on ``sock``."""
    host, port = sock.getsockname()[:2]
    return url_for(host, port, tls)


def open_collector(cfg: JobConfig) -> Any:
    """The payload collector of an RL job whose rollout store is outside the
    controller (``rl.transport.rollouts`` set to a Redis or storage URL), else None."""
    if cfg.rl is None or cfg.rl.transport.rollouts == "controller":
        return None
    from phalanx.controller.collector import Collector
    from phalanx.transport.factory import open_store

    lease_s, url = cfg.rl.loop.lease_s, cfg.rl.transport.rollouts
    return Collector(
        lambda name: open_store(url, name),
        orphan_age_s=max(600.0, 4 * lease_s),
        sweep_every_s=max(60.0, lease_s),
    )


def serve(
    cfg: JobConfig,
    state_dir: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    fresh: bool = False,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> None:
    """Run a controller in this process until it is stopped (SIGINT/SIGTERM). Files it
    creates are the owner's alone (the process umask is set to 077). ``fresh``: a damaged
    journal is moved aside and the job begins again (:func:`statedir.check_journal`).
    ``tls_cert``/``tls_key`` (PEM files, both or neither): serve HTTPS."""
    if not 0 <= port <= 65535:
        raise CannotStart(f"--port must be 0..65535 (0: any free port): got {port}.")
    tls = check_tls(tls_cert, tls_key)
    import uvicorn

    from phalanx.controller.lock import StateDirLock

    os.umask(0o077)
    prepare(state_dir)
    lock = StateDirLock(state_dir)
    lock.acquire()
    try:
        if cfg.controller.journal == "sqlite":
            moved = check_journal(state_dir, fresh)
            if moved:
                print(moved, flush=True)
        elif fresh:
            raise CannotStart(
                f"--fresh sets aside a damaged SQLite journal: got it with controller.journal = "
                f"{cfg.controller.journal!r}. To begin the job again on etcd, delete its prefix "
                f"(etcdctl del --prefix PREFIX) and start without --fresh."
            )
        sock = _bind(host, port, state_dir)
        url = url_of(sock, tls)
        warn_if_clear_text(sock.getsockname()[0], tls)
        run = Run(cfg, state_dir, url, check_addresses=not is_loopback(host))
        if cfg.controller.journal == "sqlite":
            app: Any = run.sqlite_app()
        else:
            from phalanx.controller.standby import etcd_app

            app = etcd_app(run)
        write_private(state_dir / URL_FILE, url + "\n")
        lock.note(f"pid {os.getpid()} url {url}")
        print(run.first_line, flush=True)
        config = uvicorn.Config(
            app,
            http=run.protocol(),
            log_level="warning",
            access_log=False,
            timeout_keep_alive=75,
            timeout_graceful_shutdown=1,
            backlog=2048,
            limit_concurrency=cfg.controller.max_connections,
            # Nothing reads a client's address or scheme; the X-Forwarded-* rewrite
            # cost every request from loopback a dict of its headers.
            proxy_headers=False,
            ssl_certfile=tls_cert if tls else None,
            ssl_keyfile=tls_key if tls else None,
        )
        _tune_gc()

        def release_held() -> None:
            # Held requests (heartbeats, lifelines, long-polls) answer within the
            # graceful shutdown instead of being cancelled mid-wait (uvicorn logs each of
            # those as a traceback).
            if run.service is not None:
                run.service.release_held()

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:  # SIGTERM, SIGINT
                super().handle_exit(sig, frame)
                release_held()

        server = Server(config)

        def stop() -> None:
            server.should_exit = True  # stop serving; the outbox refuses every reply meanwhile
            release_held()

        run.stop = stop
        server.run(sockets=[sock])
        run.raise_why()
    finally:
        lock.release()


class Run:
    """What one controller process serves, however it came to lead: its service and
    app once built (:meth:`build`), and why it stopped."""

    def __init__(self, cfg: JobConfig, state_dir: Path, url: str, check_addresses: bool):
        self.cfg, self.state_dir, self.url = cfg, state_dir, url
        self.check_addresses = check_addresses
        self.token = ""
        self.service: Any = None
        self.hot: Any = None
        """The hot routes the server's protocol answers (:class:`~phalanx.controller.http.hot.Hot`;
        on etcd, armed once this controller leads)."""
        self.built_hot: Any = None
        """The hot routes of the service last built."""
        self.first_line = ""
        """What the process prints once it serves (tests and launchers wait for it)."""
        self.stop: Any = lambda: None
        """Stops the server (set by :func:`serve`)."""
        self.error: BaseException | None = None
        """Why the server was stopped early (raised once it has)."""

    def sqlite_app(self) -> Any:
        """The app of a controller on the state dir's SQLite journal."""
        from phalanx.controller.journal import open_journal

        self.token = load_or_create_token(self.state_dir)
        journal = open_journal(self.cfg, self.state_dir / JOURNAL, self.url)
        # The hot routes answered in the HTTP protocol itself (http/hot.py); on etcd
        # they are armed when the controller takes office (standby/__init__.py).
        _, app = self.build(journal)
        self.hot = self.built_hot
        return app

    def protocol(self) -> Any:
        """uvicorn's ``http`` setting: the hot protocol (armed by :meth:`sqlite_app`, or
        unarmed until this controller leads on etcd) where the pinned uvicorn is the
        one it was written against, else auto."""
        from phalanx.controller.http.hot import hot_protocol

        return (hot_protocol(self.hot) if self.hot is not None else None) or "auto"

    def build(self, journal: Any) -> tuple[Any, Any]:
        """The service on ``journal`` and its app (closes the journal if it fails);
        its hot routes in :attr:`built_hot`."""
        from phalanx.controller.http import create_served
        from phalanx.controller.payloads import PayloadLog
        from phalanx.controller.service import ControllerService

        cfg = self.cfg
        try:
            service = ControllerService(
                cfg,
                journal,
                PayloadLog(self.state_dir / PAYLOADS, cfg.controller.journal_sync),
                time.monotonic,
                time.time,
                collector=open_collector(cfg),
                check_addresses=self.check_addresses,
            )
        except BaseException:
            journal.close()  # an etcd leader key goes at once
            raise
        # After the journal holds the job: from now on a missing journal is damage.
        write_private(self.state_dir / CONFIG, json.dumps(cfg.dump(), indent=2) + "\n")
        self.service = service
        service.outbox.on_deposed = lambda: self.stop()
        self.first_line = (
            f"phalanx controller for job {cfg.job.id} (epoch {service.epoch}) at {self.url}"
        )
        app, self.built_hot = create_served(service, self.token)
        return service, app

    def raise_why(self) -> None:
        """After the server stopped: raise why, if it was not asked to."""
        from phalanx.controller.journal import Deposed

        if self.error is not None:
            raise self.error
        if self.service is not None and self.service.outbox.deposed:
            raise Deposed(f"{self.service.outbox.deposed}: this controller stopped")


GC_THRESHOLDS = (200_000, 50, 100)
"""The collector's thresholds in a controller (Python's: 700, 10, 10)."""


def _tune_gc() -> None:
    """Keep the garbage collector off the hot path. Every request allocates a few
    short-lived objects, and at Python's defaults a controller of N = 1,000 spent
    a sixth of its time collecting, a full collection (walking every object the
    process ever made) taking a quarter of a second. What exists before serving
    (modules, models, the restored state) lives as long as the process: frozen, no
    collection walks it again; collections come less often, each finding more garbage.
    (``PHALANX_GC_DEFAULTS=1`` keeps Python's defaults, to compare.)"""
    if os.environ.get("PHALANX_GC_DEFAULTS"):
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
