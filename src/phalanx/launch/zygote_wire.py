"""The zygote's wire (:mod:`phalanx.launch.zygote`), shared by its two ends: one
JSON object per ``SOCK_SEQPACKET`` message, file descriptors alongside."""

from __future__ import annotations

import json
import socket
from typing import Any

MAX_MSG = 1 << 16
"""The largest message either end reads."""


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)
