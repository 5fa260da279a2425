"""A checkpoint root's identity: the one thing a role's replicas must share.

A batch is durable only once a save holding it commits in a root that every
later restart of the role reads (DESIGN.md, vocabulary). So every policy
replica registers with its root, and the controller refuses one whose root is
not its live peers' (:meth:`phalanx.controller.core.membership.Membership.add`).
The same string is not enough: ``/data/ckpt`` on two hosts' local disks is two
roots. Each root holds a marker file with a random id, written once by the
first replica that uses it; a replica registers with the id it reads there, so
two disks behind one path show two ids.

Before it joins, a replica also reads the newest step its root holds, and
registers with it: a quorum behind the job's step then waits for it, rather
than rolling the job back (:mod:`phalanx.controller.core.quorum`).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec

from phalanx.checkpoint.store import CheckpointStore, is_local

MARKER = "phalanx-root.json"
"""The marker file at the top of a checkpoint root."""


class RootError(ValueError):
    """A checkpoint root that cannot be used (one line, naming it and the fix)."""


@dataclass(frozen=True)
class RootIdentity:
    url: str
    """The root as every replica names it: an absolute path for a local one."""
    root_id: str
    """The id in its marker file."""
    latest: int
    """The newest committed checkpoint's step (0: none, or not resuming)."""


def canonical(url: str) -> str:
    """``url`` as every replica should spell it: a local path made absolute (a relative
    one means another directory in each working directory), a URL without its
    trailing slash."""
    if "://" not in url or url.startswith("file://"):
        return os.path.abspath(os.path.expanduser(url.removeprefix("file://")))
    return url.rstrip("/")


def identify(
    url: str,
    *,
    what: str = "--state",
    storage_options: dict[str, Any] | None = None,
    resume: bool = True,
) -> RootIdentity:
    """The identity of the checkpoint root ``url`` (``what`` names where it came from,
    for the one-line error), its marker written if this is the first use, and its
    newest step when ``resume``. Raises :class:`RootError` if it cannot be written."""
    root = canonical(url)
    try:
        fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
        path = path.rstrip("/")
        root_id = _local_marker(path) if is_local(fs) else _remote_marker(fs, path)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise RootError(
            f"{what} {url} must be a checkpoint root this replica can write: {why}. Name a "
            "directory this user can write, on storage every replica of the role reaches "
            "(a shared filesystem), or a storage URL."
        ) from None
    latest = (CheckpointStore(root, storage_options).latest() or 0) if resume else 0
    return RootIdentity(root, root_id, latest)


def _local_marker(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    marker = os.path.join(path, MARKER)
    fresh = json.dumps({"root_id": uuid.uuid4().hex}).encode()
    if not os.path.exists(marker):
        _place_marker(path, marker, fresh)
    # A root whose marker is there may still have been made read-only since.
    probe = os.path.join(path, f".write-probe-{uuid.uuid4().hex[:8]}")
    with open(probe, "wb"):
        pass
    os.unlink(probe)
    for _ in range(50):  # empty only between another's exclusive create and its write
        with open(marker, "rb") as f:
            data = f.read()
        if data:
            break
        time.sleep(0.02)
    return _read_id(data, marker)


def _place_marker(path: str, marker: str, fresh: bytes) -> None:
    """Writes the marker whole under a private name, then links it into place. A link
    fails if the name exists, so of two replicas that use a new root at once one places
    its marker and the other reads it, never a half-written one."""
    tmp = os.path.join(path, f".{MARKER}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(fresh)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, marker)
    except FileExistsError:
        pass
    except OSError:
        # A filesystem without hard links: an exclusive create, then the bytes (a
        # reader that comes between them finds the marker empty and reads again).
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "wb") as f:
            f.write(fresh)
            f.flush()
            os.fsync(f.fileno())
    finally:
        os.unlink(tmp)


def _remote_marker(fs: Any, path: str) -> str:
    marker = f"{path}/{MARKER}"
    fs.invalidate_cache(path)
    if not fs.exists(marker):
        # No exclusive create on an object store: two first users may both write;
        # each then reads back the one that stayed, and a replica that registered with
        # the other is refused once and reads the marker again when restarted.
        fs.pipe_file(marker, json.dumps({"root_id": uuid.uuid4().hex}).encode())
    return _read_id(fs.cat_file(marker), marker)


def _read_id(data: bytes, marker: str) -> str:
    try:
        root_id = json.loads(data)["root_id"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"its marker {marker} is damaged (delete it to start afresh)") from None
    if not isinstance(root_id, str) or not 0 < len(root_id) <= 64:
        raise ValueError(f"its marker {marker} holds no id (delete it to start afresh)")
    return root_id
