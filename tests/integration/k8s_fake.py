"""A recorded fake of the Kubernetes API server, for ``phalanx scale --kubeconfig``.

No real API server can run on the test machines (no container images can be
pulled, and no registry here ships a ``kube-apiserver`` binary), so the calls
are tested against this: a local HTTP server on a free port that answers the
requests the ``kubernetes`` client makes for ``phalanx scale`` with JSON bodies
recorded in the shape the real server returns (``k8s/*.json``, written from the
Kubernetes API reference: a batch/v1 Job, a JobList and the Status objects of a
404, 403, 401 and 422). It records every request it gets (method, path, query,
Content-Type, body) so that a test can assert the exact calls, and it keeps the
rules a real server applies to what those calls touch:

- ``Authorization: Bearer TOKEN`` or 401;
- ``GET .../namespaces/NS/jobs/NAME`` (404 when absent), ``GET .../jobs``
  with a ``labelSelector`` of ``k=v`` pairs;
- ``PATCH .../jobs/NAME`` as ``application/merge-patch+json`` (RFC 7386; any
  other patch type is 415), and an Indexed Job's ``completions`` may change
  only in tandem with ``parallelism`` (elastic Indexed Jobs) or 422;
- ``forbid`` names (verb, job) pairs that answer 403, as RBAC would.
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

FIXTURES = Path(__file__).with_name("k8s")
TOKEN = "fake-token-0123456789"
PREFIX = "/apis/batch/v1/namespaces/"


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def job(release: str, role: str, count: int, namespace: str = "ml") -> dict[str, Any]:
    """The recorded Job (k8s/job.json) as the chart names it for ``release``/``role``."""
    j = fixture("job.json")
    name = f"{release}-phalanx-{role}" if "phalanx" not in release else f"{release}-{role}"
    j["metadata"].update(name=name, namespace=namespace)
    j["metadata"]["labels"].update(
        {"app.kubernetes.io/instance": release, "phalanx.dev/role": role}
    )
    j["spec"]["template"]["metadata"]["labels"].update(
        {"batch.kubernetes.io/job-name": name, "job-name": name, "phalanx.dev/role": role}
    )
    j["spec"].update(parallelism=count, completions=count)
    j["status"].update(active=count, ready=count)
    return j


def status(code: int, name: str = "", verb: str = "") -> dict[str, Any]:
    s = fixture(f"status_{code}.json")
    text = json.dumps(s).replace("NAME", name).replace("VERB", verb)
    return dict(json.loads(text))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    body: Any


@dataclass
class FakeApiServer:
    jobs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    forbid: set[tuple[str, str]] = field(default_factory=set)
    requests: list[Request] = field(default_factory=list)
    port: int = 0

    def add(self, j: dict[str, Any]) -> None:
        self.jobs[j["metadata"]["namespace"], j["metadata"]["name"]] = j

    def kubeconfig(self, path: Path, namespace: str | None = "ml", token: str = TOKEN) -> Path:
        ctx: dict[str, Any] = {"cluster": "fake", "user": "op"}
        if namespace:
            ctx["namespace"] = namespace
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "op", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": ctx}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(cfg))  # JSON is YAML
        return path

    def handle(self, req: Request, auth: str | None) -> tuple[int, Any]:
        if auth != f"Bearer {TOKEN}":
            return 401, status(401)
        if not req.path.startswith(PREFIX):
            return 404, status(404)
        ns, _, rest = req.path[len(PREFIX) :].partition("/")
        parts = rest.split("/")
        if req.method == "GET" and parts == ["jobs"]:
            want = dict(
                kv.split("=", 1) for kv in req.query.get("labelSelector", "").split(",") if kv
            )
            items = [
                j
                for (n, _), j in sorted(self.jobs.items())
                if n == ns and want.items() <= j["metadata"]["labels"].items()
            ]
            return 200, {**fixture("job_list.json"), "items": items}
        if len(parts) != 2 or parts[0] != "jobs":
            return 404, status(404)
        name = parts[1]
        verb = {"GET": "get", "PATCH": "patch"}.get(req.method, req.method.lower())
        if (verb, name) in self.forbid:
            return 403, status(403, name, verb)
        j = self.jobs.get((ns, name))
        if j is None:
            return 404, status(404, name)
        if req.method == "GET":
            return 200, j
        if req.method != "PATCH":
            return 405, status(404, name)
        if req.content_type != "application/merge-patch+json":
            return 415, {"kind": "Status", "code": 415, "message": str(req.content_type)}
        new = merge_patch(copy.deepcopy(j), req.body)
        indexed = new["spec"].get("completionMode") == "Indexed"
        if indexed and new["spec"]["completions"] != new["spec"]["parallelism"]:
            return 422, status(422, name)
        new["metadata"]["generation"] += 1
        new["metadata"]["resourceVersion"] = str(int(new["metadata"]["resourceVersion"]) + 1)
        self.jobs[ns, name] = new
        return 200, new

    def __enter__(self) -> FakeApiServer:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                url = urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                req = Request(
                    self.command,
                    url.path,
                    dict(parse_qsl(url.query)),
                    self.headers.get("Content-Type"),
                    json.loads(raw) if raw else None,
                )
                fake.requests.append(req)
                code, body = fake.handle(req, self.headers.get("Authorization"))
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve()

            def do_PATCH(self) -> None:
                self._serve()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
