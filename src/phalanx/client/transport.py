"""The HTTP side of talking to a controller: where it is, the job token, and one
typed call with retries.

:class:`Transport` sends a request model of :mod:`phalanx.protocol` and parses
the reply into its reply model; nothing here builds or reads a dict. It hides,
and how:

- **transient network errors and a restarting controller**: every call
  retries with exponential backoff and full jitter, up to
  ``unreachable_timeout_s``. Given a state dir instead of a URL, it re-reads
  ``DIR/url`` while it retries, in case the controller came back on another
  port.
- **several controllers, one leader**: given a comma-separated list of URLs
  (``http://a:8080,http://b:8080,http://c:8080``), each call starts at the
  controller the last successful call reached (:attr:`Transport.url`). A
  standby answers 421 with the leader's URL, and the call goes there at once;
  a controller that fails (network error or 5xx) sends the call's next attempt
  to the next URL of the list, so a call finds the new leader after a failover
  by itself. Each call keeps its own place in the list: threads calling at
  once never move each other's.

It raises :class:`ControllerUnreachable` after ``unreachable_timeout_s`` of
failed attempts, :class:`Evicted` on 410, and :class:`Rejected` for any other
refusal (4xx, with the fields the controller named).

An ``https://`` controller is verified against the CA file of
:data:`phalanx.env.CA_FILE` (``--ca-file``), else the system's CAs
(:func:`verify_context`, which every httpx client of the controller uses). A
certificate that fails that check raises :class:`CertificateMismatch` at once:
retrying cannot heal it.
"""

from __future__ import annotations

import functools
import os
import random
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ValidationError

from phalanx import env
from phalanx.protocol.base import ErrorBody

R = TypeVar("R", bound=BaseModel)


class ControllerError(RuntimeError):
    pass


class ControllerUnreachable(ControllerError):
    def __init__(self, message: str, last_error: str = ""):
        super().__init__(message)
        self.last_error = last_error
        """What the last attempt failed with."""


class Rejected(ControllerError):
    def __init__(self, status: int, body: ErrorBody):
        self.status = status
        self.body = body
        fields = ", ".join(f"{f.field}: {f.message}" for f in body.fields)
        super().__init__(
            f"controller refused the request ({status}): {body.error}"
            + (f" [{fields}]" if fields else "")
        )


class Evicted(Rejected):
    """This incarnation is no longer a member (HTTP 410)."""


class QuorumTimeout(ControllerError):
    pass


class CertificateMismatch(ControllerError):
    """The controller's TLS certificate failed verification: not signed by a trusted
    CA, or it does not name the host of the URL. Never retried."""


def verify_context() -> ssl.SSLContext:
    """What every httpx client of the controller verifies ``https://`` with (its
    ``verify=``): the CA file of :data:`phalanx.env.CA_FILE` when set, else the
    system's CAs. One context per CA file and process, shared by its clients
    (contexts are thread-safe, and building one reads the CA files)."""
    return _context(os.environ.get(env.CA_FILE, ""))


@functools.lru_cache(maxsize=4)
def _context(ca_file: str) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ControllerError(
            f"--ca-file (${env.CA_FILE}) must be a readable PEM file of CA certificates: "
            f"got {ca_file!r} ({why}). Pass the CA that signed the controller's certificate."
        ) from None


def certificate_mismatch(url: str, error: BaseException) -> CertificateMismatch | None:
    """The one-line error for ``error`` when it is (or was caused by) a failed
    certificate verification of the controller at ``url``, else None."""
    cause: BaseException | None = error
    for _ in range(8):  # httpx -> httpcore -> ssl; bounded in case of a cycle
        if cause is None:
            return None
        if isinstance(cause, ssl.SSLCertVerificationError):
            host = urlsplit(url).hostname or url
            why = str(cause.verify_message or cause.reason or cause).rstrip(".")
            return CertificateMismatch(
                f"controller at {url}: its TLS certificate does not match (certificate verify "
                f"failed: {why}): check --ca-file (${env.CA_FILE}) and that the certificate "
                f"names {host}"
            )
        cause = cause.__cause__ or cause.__context__
    return None


MAX_REDIRECTS = 8
"""421 answers (a standby naming the leader) followed in a row before a call counts
the attempt as failed: standbys that name each other during an election must not
keep a call spinning."""


def split_urls(controller: str) -> list[str]:
    """The URLs of a comma-separated list of controllers, in order, without repeats.
    Raises :class:`ControllerError` when an entry is not an http(s) URL."""
    urls: list[str] = []
    for part in controller.split(","):
        u = part.strip().rstrip("/")
        if not u.startswith(("http://", "https://")) or not urlsplit(u).hostname:
            raise ControllerError(
                f"controller must be a URL (http://host:port), a comma-separated list of "
                f"them, or a controller state dir: got {part.strip()!r} in {controller!r}."
            )
        if u not in urls:
            urls.append(u)
    return urls


def resolve(controller: str) -> tuple[str, Path | None]:
    """A controller is named by URL (or a comma-separated list of URLs: the first is
    returned) or by state dir. Returns (url, state_dir)."""
    if controller.startswith(("http://", "https://")):
        return split_urls(controller)[0], None
    d = Path(controller)
    url_file = d / "url" if d.is_dir() else d
    try:
        return url_file.read_text().strip().rstrip("/"), url_file.parent
    except OSError as e:
        raise ControllerError(
            f"controller must be a URL (http://host:port) or a controller state dir with a "
            f"'url' file: got {controller!r} ({e.strerror})."
        ) from None


def find_token(state_dir: Path | None) -> str:
    token = os.environ.get(env.TOKEN)
    if token:
        return token
    if state_dir is not None and (state_dir / "token").exists():
        return (state_dir / "token").read_text().strip()
    raise ControllerError(
        f"a job token is needed to talk to the controller: set ${env.TOKEN}, or name the "
        f"controller by its state dir so the token file can be read."
    )


def _error_body(r: httpx.Response) -> ErrorBody:
    try:
        return ErrorBody.model_validate_json(r.content)
    except ValidationError:
        return ErrorBody(error=r.text[:200] or f"HTTP {r.status_code}")


class Transport:
    """Typed calls to one controller, with retries. Thread-safe: each thread that
    holds long-polls passes its own ``httpx.Client`` (:meth:`http_client`)."""

    def __init__(
        self,
        controller: str,
        *,
        token: str | None = None,
        unreachable_timeout_s: float = 30.0,
        on_epoch: Callable[[int | None, int], None] | None = None,
    ):
        self.url, self.state_dir = resolve(controller)
        self.urls = split_urls(controller) if self.state_dir is None else [self.url]
        """Every controller this transport may talk to (the list it was given, then any
        leader a standby named)."""
        self._urls_lock = threading.Lock()
        self.leader_changes = 0
        """How often the calls moved to another controller (a failover, seen from here)."""
        self.token = token or find_token(self.state_dir)
        self.unreachable_timeout_s = unreachable_timeout_s
        self.on_epoch = on_epoch
        """Called with (old, new) when the controller's epoch changes (it restarted)."""
        self.epoch: int | None = None
        self.closed = False
        self._http = self.http_client()

    def http_client(self) -> httpx.Client:
        return httpx.Client(
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=30.0,
            verify=verify_context(),
        )

    def call(
        self,
        path: str,
        req: BaseModel | None,
        reply: type[R],
        *,
        timeout: float = 30.0,
        http: httpx.Client | None = None,
    ) -> R:
        """POST ``req`` (GET when None) to ``path`` and parse the reply as ``reply``."""
        http = http or self._http
        body = None if req is None else req.model_dump_json().encode()
        headers = {"content-type": "application/json"}
        first_failure: float | None = None
        backoff = 0.05
        last_error = ""
        errors: dict[str, str] = {}  # the last error of each controller tried
        redirects = 0
        tried = 1  # controllers of the list tried since the first failure
        # This call's own cursor in the list: threads that call at once (heartbeats,
        # long-polls) must not move each other's. Where a call succeeds becomes
        # everyone's first try (self.url).
        url = self.url
        while True:
            stay = False
            try:
                if body is None:
                    r = http.get(url + path, timeout=timeout)
                else:
                    r = http.post(url + path, content=body, headers=headers, timeout=timeout)
                if r.status_code == 421 and redirects < MAX_REDIRECTS:
                    leader = _error_body(r).leader.rstrip("/")
                    redirects += 1
                    if leader and leader != url:
                        url = self._known(leader)
                        continue
                    # Naming itself, it won an election and is taking over: ask it again.
                    stay = leader == url
                    last_error = (
                        f"controller at {url} is taking over as the leader"
                        if stay
                        else f"controller at {url} is a standby and knows no leader yet"
                    )
                elif r.status_code == 421:
                    last_error = f"{redirects} standbys in a row named no reachable leader"
                elif r.status_code < 500:
                    self._move_to(url)
                    return self._handle(r, reply)
                else:
                    last_error = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.TransportError as e:
                mismatch = certificate_mismatch(url, e)
                if mismatch is not None:
                    raise mismatch from None
                last_error = str(e) or type(e).__name__
            errors[url] = last_error
            if self.closed:
                raise ControllerUnreachable(f"client closed while calling {path}")
            now = time.monotonic()
            first_failure = first_failure or now
            # Past the timeout once every controller of the list had its try.
            if now - first_failure > self.unreachable_timeout_s and tried >= len(self.urls):
                what = f"controller at {url} unreachable"
                why = f"last error: {last_error}"
                if len(self.urls) > 1:
                    what = f"controllers at {', '.join(self.urls)} unreachable"
                    why = "last errors: " + "; ".join(f"{u}: {e}" for u, e in errors.items())
                raise ControllerUnreachable(
                    f"{what} for {now - first_failure:.0f} s ({why})", last_error
                )
            time.sleep(random.uniform(0, backoff))
            backoff = min(backoff * 2, 2.0)
            redirects = 0
            if self.state_dir is not None:
                try:
                    url = self.url = resolve(str(self.state_dir))[0]
                except ControllerError:
                    pass
            elif len(self.urls) > 1:
                if not stay:
                    url = self.urls[(self.urls.index(url) + 1) % len(self.urls)]
                tried += 1

    def _known(self, url: str) -> str:
        """``url`` (a leader a standby named), added to the list if it is new."""
        with self._urls_lock:
            if url not in self.urls:
                self.urls.append(url)
        return url

    def _move_to(self, url: str) -> None:
        """A call succeeded at ``url``: the next calls try it first."""
        with self._urls_lock:
            if url != self.url:
                self.url = url
                self.leader_changes += 1

    def _handle(self, r: httpx.Response, reply: type[R]) -> R:
        if r.status_code == 410:
            raise Evicted(r.status_code, _error_body(r))
        if r.status_code == 401:
            raise ControllerError(
                f"controller at {self.url} refused the job token (401): check ${env.TOKEN} "
                f"or the state dir's token file."
            )
        if r.status_code >= 400:
            raise Rejected(r.status_code, _error_body(r))
        try:
            out = reply.model_validate_json(r.content)
        except ValidationError as e:
            raise ControllerError(
                f"controller at {self.url} sent a reply that is not a {reply.__name__}: "
                f"{e.error_count()} error(s), first: {e.errors()[0]['msg']} at "
                f"{'.'.join(str(x) for x in e.errors()[0]['loc'])}. Are the controller and "
                f"this replica the same phalanx version?"
            ) from None
        epoch = getattr(out, "epoch", None)
        if isinstance(epoch, int) and epoch != self.epoch:
            if self.on_epoch is not None:
                self.on_epoch(self.epoch, epoch)
            self.epoch = epoch
        return out

    def close(self) -> None:
        self.closed = True
        self._http.close()
