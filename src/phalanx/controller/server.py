"""Start a controller: lock the state dir, load the token and the journal, bind,
publish the URL, serve.

The state dir holds everything the controller needs to come back after a
SIGKILL: ``journal.sqlite`` (state), ``payloads/`` (the payload log of the
``controller`` rollout store), ``token`` (mode 0600), ``config.json`` (the
resolved job config), ``url`` (where it listens) and ``controller.lock``. Restarted with ``--port 0``, a controller first tries
the port it had before, so replicas that only know the URL re-attach by
themselves; if that port is taken it picks a new one and rewrites ``url``.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from phalanx import env
from phalanx.config import JobConfig

URL_FILE = "url"
TOKEN_FILE = "token"


def load_or_create_token(state_dir: Path) -> str:
    """The job token: ``$PHALANX_TOKEN`` if set, else the state dir's token file,
    created (mode 0600) at first start."""
    given = os.environ.get(env.TOKEN)
    if given:
        return given
    path = state_dir / TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if not token:
            raise RuntimeError(
                f"token file {path} must hold the job token: it is empty. Delete it to have a "
                f"new token generated, or set ${env.TOKEN}."
            ) from None
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _bind(host: str, port: int, state_dir: Path) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    candidates = [port]
    if port == 0 and (state_dir / URL_FILE).exists():
        previous = urlsplit((state_dir / URL_FILE).read_text().strip()).port
        if previous:
            candidates.insert(0, previous)
    err: OSError | None = None
    for p in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
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
    raise OSError(
        f"controller could not bind {host}:{port}: {err}. Pick a free --port or use --port 0."
    )


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


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


def serve(cfg: JobConfig, state_dir: Path, host: str = "127.0.0.1", port: int = 0) -> None:
    """Run a controller in this process until it is stopped (SIGINT/SIGTERM)."""
    import uvicorn

    from phalanx.controller.http import create_app
    from phalanx.controller.journal import Journal
    from phalanx.controller.lock import StateDirLock
    from phalanx.controller.payloads import PayloadLog
    from phalanx.controller.service import ControllerService

    state_dir.mkdir(parents=True, exist_ok=True)
    lock = StateDirLock(state_dir)
    lock.acquire()
    try:
        token = load_or_create_token(state_dir)
        _write_atomic(state_dir / "config.json", json.dumps(cfg.dump(), indent=2) + "\n")
        sync = cfg.controller.journal_sync
        service = ControllerService(
            cfg,
            Journal(state_dir / "journal.sqlite", sync),
            PayloadLog(state_dir / "payloads", sync),
            time.monotonic,
            time.time,
            collector=open_collector(cfg),
        )
        app = create_app(service, token)
        sock = _bind(host, port, state_dir)
        url = url_of(sock)
        _write_atomic(state_dir / URL_FILE, url + "\n")
        lock.note(f"pid {os.getpid()} url {url}")
        print(
            f"phalanx controller for job {cfg.job.id} (epoch {service.epoch}) at {url}", flush=True
        )
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=75,
            timeout_graceful_shutdown=1,
            backlog=2048,
        )
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        lock.release()
