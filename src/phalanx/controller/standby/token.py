"""The job token of a controller on an etcd journal, shared through the prefix.

A standby on another host has no copy of the first controller's state dir, so the
token also lives at ``P/token`` (written once, by the first controller that has or
makes one; never replaced). A controller takes, in order: ``$PHALANX_TOKEN``, its
state dir's ``token`` file, ``P/token``, or a new one; and it leaves the token in its
state dir (0600) for the tools pointed there. Whoever can read the prefix can read
the job's state anyway: the token adds nothing it did not have.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from phalanx import env
from phalanx.controller.journal.etcd_kv import EtcdKV, get, put, ranged, same_mod
from phalanx.controller.statedir import TOKEN_FILE, CannotStart, write_private


def shared_token(state_dir: Path, kv: EtcdKV, prefix: str) -> str:
    """The job's token (see the module docstring). Raises JournalUnavailable when etcd
    does not answer, CannotStart for an empty token file."""
    path = state_dir / TOKEN_FILE
    key = f"{prefix}/token"
    token = os.environ.get(env.TOKEN, "").strip()
    if not token and path.is_file():
        token = path.read_text().strip()
        if not token:
            raise CannotStart(
                f"token file {path} must hold the job token: it is empty. Delete it to have "
                f"the job's token taken from etcd, or set ${env.TOKEN}."
            )
    if not token:
        stored = kv.get(key)
        token = stored["value"].decode().strip() if stored is not None else ""
    made = not token
    if made:
        token = secrets.token_urlsafe(32)
    # Written only if absent: the first controller's token stays the job's.
    reply = kv.txn([same_mod(key, 0)], [put(key, token.encode())], [get(key)])
    if made and not reply.get("succeeded"):
        stored = ranged(reply, 0)  # another controller made one first: take it
        token = stored["value"].decode().strip() if stored is not None else token
    if not path.is_file() or path.read_text().strip() != token:
        write_private(path, token + "\n")
    return token
