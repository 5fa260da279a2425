"""moto's S3 server (``python -m moto.server``'s app) with one fix for the tests:
a conditional PUT (``If-None-Match: *``, create only if absent) is atomic, as it
is on real S3. moto checks that the key is absent and stores it later, in a
threaded server with no lock between, so two concurrent creates can both win
(shown with two PUTs held between the check and the store); DiLoCo's object-store
rounds rely on exactly one winning. Every conditional PUT runs under one lock here;
everything else stays concurrent.

    python tests/integration/moto_server.py -H 127.0.0.1 -p 0
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from moto import server

_CREATE = threading.Lock()


def atomic_creates(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    def wrapped(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") == "PUT" and environ.get("HTTP_IF_NONE_MATCH"):
            with _CREATE:
                return list(app(environ, start_response))  # (the whole answer, locked)
        return app(environ, start_response)

    return wrapped


class _App(server.DomainDispatcherApplication):  # type: ignore[misc]
    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        return atomic_creates(super().__call__)(environ, start_response)


if __name__ == "__main__":
    server.DomainDispatcherApplication = _App  # the class moto's main() builds its app from
    server.main(sys.argv[1:])
