"""``phalanx scale ROLE=N --kubeconfig PATH``: scale a role of a Helm release of
``deploy/helm/phalanx`` in the cluster, through the official ``kubernetes`` client.

Each role of the chart is an Indexed Job (``RELEASE-phalanx-ROLE``) whose
``completions`` and ``parallelism`` are both the role's pod count. Kubernetes
(>= 1.27, "elastic Indexed Jobs") lets both change together, as long as they stay
equal: more indexes start new pods, which join the job and heal; fewer delete the
pods of the highest indexes (their agents get SIGTERM and stop their workers), as
``phalanx run`` stops the highest-numbered surplus replicas.

Two requests per role, and nothing else: ``GET`` the Job (is it there, is it
Indexed, has it finished), then one JSON merge ``PATCH`` of ``spec.parallelism``
and ``spec.completions``. Every failure is one line (``SystemExit``) that names
the Job, the namespace and what to do. ``kubernetes`` is imported inside the
functions (the ``k8s`` extra), so that ``phalanx --help`` stays fast and a job
without Kubernetes needs no client.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Scaled", "add_kubernetes", "job_name", "scale_jobs"]

CHART_NAME = "phalanx"
FIELD_MANAGER = "phalanx-scale"
"""Recorded by the API server as the writer of the patched fields (managedFields)."""


def add_kubernetes(p: argparse.ArgumentParser) -> None:
    """``--kubeconfig``, ``--namespace`` and ``--release`` of ``phalanx scale``."""
    p.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="scale the Helm release's Indexed Jobs in the cluster this kubeconfig reaches "
        "(needs the k8s extra: pip install 'phalanx[k8s]'); --controller is then optional",
    )
    p.add_argument(
        "--namespace",
        "-n",
        help="the release's namespace (default: the kubeconfig context's, else 'default')",
    )
    p.add_argument(
        "--release", help="the Helm release (`helm install RELEASE ...`); with --kubeconfig"
    )


def job_name(release: str, role: str) -> str:
    """The chart's Job of ``role`` in ``release``: ``phalanx.fullname`` (_helpers.tpl,
    without nameOverride/fullnameOverride) then ``-ROLE``."""
    base = release if CHART_NAME in release else f"{release}-{CHART_NAME}"
    return f"{base[:40].removesuffix('-')}-{role}"


@dataclass(frozen=True)
class Scaled:
    """One role's Job, before and after the patch."""

    role: str
    job: str
    namespace: str
    before: int
    after: int


def _fail(msg: str) -> SystemExit:
    return SystemExit(f"phalanx scale: {msg}")


def _api(kubeconfig: str, namespace: str | None) -> tuple[Any, str]:
    """A ``BatchV1Api`` for the kubeconfig's current context, and the namespace."""
    path = Path(kubeconfig).expanduser()
    try:
        text = path.read_text()
    except OSError as e:
        raise _fail(
            f"--kubeconfig must be a readable kubeconfig file: got {kubeconfig} "
            f"({e.strerror or e}). Pass the file kubectl uses (~/.kube/config)."
        ) from None
    try:
        from kubernetes import client, config
    except ImportError:
        raise _fail(
            "--kubeconfig needs the kubernetes client: it is not installed. "
            "Install it with pip install 'phalanx[k8s]'."
        ) from None
    import yaml

    try:
        doc = yaml.safe_load(text)
        if not isinstance(doc, dict):
            raise config.ConfigException("not a YAML mapping")
        _, current = config.list_kube_config_contexts(config_file=str(path))
        conf = client.Configuration()
        # persist_config=False: a refreshed token is not written back into the file.
        config.load_kube_config(str(path), client_configuration=conf, persist_config=False)
    except (config.ConfigException, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise _fail(
            f"--kubeconfig must be a kubeconfig with a current context: got {kubeconfig} "
            f"({why}). Check it with kubectl --kubeconfig {kubeconfig} config view."
        ) from None
    # One try: a refused connection is reported at once, not after urllib3's backoff.
    conf.retries = False
    ns = namespace or (current or {}).get("context", {}).get("namespace") or "default"
    return client.BatchV1Api(client.ApiClient(conf)), ns


def _api_message(e: Any) -> str:
    """The API server's own message from an ApiException's Status body."""
    try:
        return str(json.loads(e.body).get("message") or e.reason)
    except (TypeError, ValueError, AttributeError):
        return " ".join(str(e.reason or "").split()) or "no message"


def _refused(e: Any, what: str, ns: str, server: str) -> SystemExit:
    status = int(e.status or 0)
    if status == 0:
        return _fail(f"cannot reach the Kubernetes API server at {server}: {_api_message(e)}.")
    if status in (401, 403):
        return _fail(
            f"the API server refused to {what} in namespace {ns} ({status} "
            f"{e.reason}: {_api_message(e)}). The kubeconfig's user needs get and patch on "
            f"jobs.batch there."
        )
    return _fail(
        f"the API server refused to {what} in namespace {ns} ({status}: {_api_message(e)})."
    )


def _missing(batch: Any, release: str, role: str, name: str, ns: str) -> SystemExit:
    """404 on the Job: say which roles the release has, if the API lets us list them."""
    from kubernetes.client.exceptions import ApiException

    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=replica"
    try:
        jobs = batch.list_namespaced_job(ns, label_selector=selector).items
    except ApiException:
        jobs = None
    if jobs:
        roles = sorted((j.metadata.labels or {}).get("phalanx.dev/role", "?") for j in jobs)
        return _fail(
            f"role must be one of release {release}'s roles {roles}: got {role} (no Job {name} "
            f"in namespace {ns})."
        )
    return _fail(
        f"the workload is not there: no Job {name} in namespace {ns} (404). Is release "
        f"{release} installed there with this chart? Pass --release and --namespace as in "
        f"helm install."
    )


def _finished(job: Any) -> str | None:
    for c in (job.status.conditions if job.status else None) or []:
        if c.type in ("Complete", "Failed") and c.status == "True":
            return str(c.type)
    return None


def scale_jobs(
    kubeconfig: str, namespace: str | None, release: str | None, want: dict[str, int]
) -> list[Scaled]:
    """Patch each role's Indexed Job to ``want[role]`` pods; one line on any failure.

    Every Job is read (and checked) before any is patched, so that a missing role
    or a finished Job changes nothing.
    """
    if not release:
        raise _fail(
            "--release must name the Helm release with --kubeconfig: got none. Pass "
            "--release RELEASE as in helm install RELEASE deploy/helm/phalanx."
        )
    zero = sorted(role for role, n in want.items() if n < 1)
    if zero:
        raise _fail(
            f"count must be >= 1 with --kubeconfig: got {zero[0]}={want[zero[0]]} (an "
            f"Indexed Job of 0 completions is complete at once and ends the role for good)."
        )
    from urllib3.exceptions import HTTPError

    batch, ns = _api(kubeconfig, namespace)
    server = batch.api_client.configuration.host
    try:
        return _scale(batch, ns, server, release, want)
    except HTTPError as e:
        why = " ".join(str(getattr(e, "reason", None) or e).split())
        raise _fail(f"cannot reach the Kubernetes API server at {server}: {why}.") from None


def _scale(batch: Any, ns: str, server: str, release: str, want: dict[str, int]) -> list[Scaled]:
    from kubernetes.client.exceptions import ApiException

    current: dict[str, tuple[str, int]] = {}
    for role in want:
        name = job_name(release, role)
        try:
            job = batch.read_namespaced_job(name, ns)
        except ApiException as e:
            if e.status == 404:
                raise _missing(batch, release, role, name, ns) from None
            raise _refused(e, f"get Job {name}", ns, server) from None
        if job.spec.completion_mode != "Indexed":
            raise _fail(
                f"Job {name} in namespace {ns} must be an Indexed Job: got completionMode "
                f"{job.spec.completion_mode}. Upgrade the release to this chart."
            )
        done = _finished(job)
        if done:
            raise _fail(f"Job {name} in namespace {ns} has finished ({done}): nothing to scale.")
        current[role] = (name, int(job.spec.completions or 0))
    out = []
    for role, n in want.items():
        name, before = current[role]
        # Both together, equal: the API refuses an Indexed Job whose parallelism and
        # completions change apart.
        body = {"spec": {"parallelism": n, "completions": n}}
        try:
            job = batch.patch_namespaced_job(
                name,
                ns,
                body,
                field_manager=FIELD_MANAGER,
                _content_type="application/merge-patch+json",
            )
        except ApiException as e:
            raise _refused(e, f"patch Job {name}", ns, server) from None
        out.append(Scaled(role, name, ns, before, int(job.spec.completions)))
    return out
