"""``phalanx scale ROLE=N --kubeconfig PATH --release R``: the official ``kubernetes``
client against a recorded fake of the API server (``k8s_fake.py``: no real API
server can run here). Asserted: the exact requests (GET the Job, then one merge
PATCH of parallelism and completions together, with phalanx's field manager),
the Job the fake then holds, the command's output, and one-line errors for a
missing or bad kubeconfig, a role the release has not, a release that is not
there, a refusal (403), a finished Job, and a count of 0."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_fake import FakeApiServer, Request, job
from procs import Controller, child_env

from phalanx import cli

pytest.importorskip("kubernetes", reason="the k8s extra: pip install 'phalanx[k8s]'")

JOBS = "/apis/batch/v1/namespaces/ml/jobs"
MERGE = "application/merge-patch+json"


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        fake.add(job("sort", "policy", 1))
        fake.add(job("sort", "rollout", 2))
        yield fake


def _get(name: str) -> Request:
    return Request("GET", f"{JOBS}/{name}", {}, None, None)


def _patch(name: str, n: int) -> Request:
    body = {"spec": {"parallelism": n, "completions": n}}
    return Request("PATCH", f"{JOBS}/{name}", {"fieldManager": "phalanx-scale"}, MERGE, body)


def _count(api: FakeApiServer, role: str) -> tuple[int, int]:
    spec = api.jobs["ml", f"sort-phalanx-{role}"]["spec"]
    return spec["parallelism"], spec["completions"]


def test_scale_patches_the_role_s_indexed_job(api: FakeApiServer, tmp_path: Path):
    # The real command line, in its own process; the namespace is the context's.
    kube = api.kubeconfig(tmp_path / "kubeconfig")
    argv = ["scale", "rollout=5", "--kubeconfig", str(kube), "--release", "sort"]
    env = {k: v for k, v in child_env().items() if k != "PHALANX_CONTROLLER"}
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == "rollout: Job sort-phalanx-rollout in ml: 2 -> 5 pods\n"
    assert api.requests == [_get("sort-phalanx-rollout"), _patch("sort-phalanx-rollout", 5)]
    assert _count(api, "rollout") == (5, 5) and _count(api, "policy") == (1, 1)
    assert api.jobs["ml", "sort-phalanx-rollout"]["metadata"]["generation"] == 2


def test_every_job_is_read_before_any_is_patched_and_down_works_too(
    api: FakeApiServer, tmp_path: Path, capsys, monkeypatch
):
    monkeypatch.delenv("PHALANX_CONTROLLER", raising=False)
    kube = api.kubeconfig(tmp_path / "kubeconfig", namespace=None)
    argv = ["scale", "policy=3,rollout=1", "--kubeconfig", str(kube), "--release", "sort"]
    assert cli.main([*argv, "-n", "ml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "kubernetes": {
            "policy": {"job": "sort-phalanx-policy", "namespace": "ml", "from": 1, "to": 3},
            "rollout": {"job": "sort-phalanx-rollout", "namespace": "ml", "from": 2, "to": 1},
        }
    }
    assert api.requests == [
        _get("sort-phalanx-policy"),
        _get("sort-phalanx-rollout"),
        _patch("sort-phalanx-policy", 3),
        _patch("sort-phalanx-rollout", 1),
    ]
    assert (_count(api, "policy"), _count(api, "rollout")) == ((3, 3), (1, 1))
    # Without --namespace and without one in the context: "default", where nothing is.
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert "no Job sort-phalanx-policy in namespace default (404)" in str(e.value)


def test_with_a_controller_named_too_it_records_the_desired_count(
    api: FakeApiServer, start_controller, tmp_path: Path, capsys
):
    ctl: Controller = start_controller()
    kube = api.kubeconfig(tmp_path / "kubeconfig")
    argv = ["scale", "rollout=3", "--kubeconfig", str(kube), "--release", "sort"]
    assert cli.main([*argv, "--controller", str(ctl.state_dir)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "rollout: Job sort-phalanx-rollout in ml: 2 -> 3 pods",
        "desired replicas: rollout=3",
    ]
    assert _count(api, "rollout") == (3, 3)
    assert ctl.status()["roles"]["rollout"]["desired"] == 3


def _refused(argv: list[str], monkeypatch) -> str:
    monkeypatch.delenv("PHALANX_CONTROLLER", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["scale", *argv])
    msg = str(e.value)
    assert msg.startswith("phalanx scale: ") and "\n" not in msg, msg
    return msg


def test_a_role_or_release_that_is_not_there_is_named(api: FakeApiServer, tmp_path, monkeypatch):
    kube = str(api.kubeconfig(tmp_path / "kubeconfig"))
    del api.jobs["ml", "sort-phalanx-rollout"]
    msg = _refused(
        ["policy=2", "rollout=3", "--kubeconfig", kube, "--release", "sort"], monkeypatch
    )
    assert msg == (
        "phalanx scale: role must be one of release sort's roles ['policy']: got rollout "
        "(no Job sort-phalanx-rollout in namespace ml)."
    )
    msg = _refused(["policy=2", "--kubeconfig", kube, "--release", "tsp"], monkeypatch)
    assert "the workload is not there: no Job tsp-phalanx-policy in namespace ml (404)" in msg
    # Nothing was patched: every Job is read first.
    assert [r.method for r in api.requests] == ["GET", "GET", "GET", "GET", "GET"]
    assert _count(api, "policy") == (1, 1)


def test_a_refusal_a_finished_job_and_zero_change_nothing(
    api: FakeApiServer, tmp_path, monkeypatch
):
    kube = str(api.kubeconfig(tmp_path / "kubeconfig"))
    base = ["--kubeconfig", kube, "--release", "sort"]
    api.forbid.add(("patch", "sort-phalanx-rollout"))
    msg = _refused(["rollout=4", *base], monkeypatch)
    assert msg.startswith(
        "phalanx scale: the API server refused to patch Job sort-phalanx-rollout in namespace "
        'ml (403 Forbidden: jobs.batch "sort-phalanx-rollout" is forbidden: User '
    )
    assert msg.endswith("needs get and patch on jobs.batch there.")
    api.jobs["ml", "sort-phalanx-policy"]["status"]["conditions"] = [
        {"type": "Complete", "status": "True", "lastTransitionTime": "2026-11-02T10:00:00Z"}
    ]
    msg = _refused(["policy=2", *base], monkeypatch)
    assert msg == (
        "phalanx scale: Job sort-phalanx-policy in namespace ml has finished (Complete): "
        "nothing to scale."
    )
    msg = _refused(["rollout=0", *base], monkeypatch)
    assert "count must be >= 1 with --kubeconfig: got rollout=0" in msg
    assert _count(api, "rollout") == (2, 2) and _count(api, "policy") == (1, 1)


def test_a_bad_kubeconfig_or_no_release_is_one_line(api: FakeApiServer, tmp_path, monkeypatch):
    good = str(api.kubeconfig(tmp_path / "kubeconfig"))
    msg = _refused(
        ["rollout=2", "--kubeconfig", str(tmp_path / "none"), "--release", "sort"], monkeypatch
    )
    assert "--kubeconfig must be a readable kubeconfig file: got " in msg
    assert "(No such file or directory)" in msg
    (tmp_path / "bad").write_text("apiVersion: v1\nkind: Config\ncontexts: []\n")
    msg = _refused(
        ["rollout=2", "--kubeconfig", str(tmp_path / "bad"), "--release", "sort"], monkeypatch
    )
    assert "--kubeconfig must be a kubeconfig with a current context: got " in msg
    msg = _refused(["rollout=2", "--kubeconfig", good], monkeypatch)
    assert "--release must name the Helm release with --kubeconfig: got none" in msg
    # A wrong token: the server's 401, in one line.
    wrong = str(api.kubeconfig(tmp_path / "wrong", token="stale"))
    msg = _refused(["rollout=2", "--kubeconfig", wrong, "--release", "sort"], monkeypatch)
    assert "refused to get Job sort-phalanx-rollout in namespace ml (401 Unauthorized" in msg
    assert api.requests and all(r.method == "GET" for r in api.requests)


def test_an_unreachable_api_server_is_one_line(tmp_path, monkeypatch):
    with FakeApiServer() as gone:
        kube = str(gone.kubeconfig(tmp_path / "kubeconfig"))
    msg = _refused(["rollout=2", "--kubeconfig", kube, "--release", "sort"], monkeypatch)
    assert msg.startswith(
        f"phalanx scale: cannot reach the Kubernetes API server at http://127.0.0.1:{gone.port}"
    )
