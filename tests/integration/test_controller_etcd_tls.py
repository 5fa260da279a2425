"""The etcd journal over TLS (``etcds://``): a real etcd serving its clients with a
certificate and asking each for one (``--client-cert-auth``); a leader and a standby
journal, follow (the standby's watch is over TLS too) and fail over through it. A
client certificate etcd does not accept, a CA file that is not there and TLS files
without ``etcds://`` are each refused in one line."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from certs import CA
from etcd_server import ETCD, MISSING, TLS, Cluster, Member
from procs import Controller, Procs, Replica, check_rounds, child_env, wait_for, write_job_toml
from test_controller_standby import quorums_agree

from phalanx import env
from phalanx.net import free_port

pytestmark = pytest.mark.skipif(ETCD is None, reason=MISSING)


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, CA, Path]]:
    """One etcd member on loopback over TLS, its CA, and a client certificate's dir."""
    d = tmp_path_factory.mktemp("etcd-tls")
    ca = CA(d / "ca")
    server = ca.server("etcd", "127.0.0.1", client_too=True)
    client = ca.client("controller")
    tls = TLS(server.cert, server.key, ca.pem, client.cert, client.key)
    m = Member("tls0", free_port(), free_port(), d, tls=tls)
    cluster = Cluster([m])
    m.start(cluster.spec)
    try:
        cluster.wait_healthy()
        yield cluster, ca, d
    finally:
        cluster.stop()


def job_config(tmp: Path, cluster: Cluster, ca: CA, **tls: str) -> tuple[Path, str]:
    job_id = f"tls-{uuid.uuid4().hex[:6]}"
    client = ca.client(f"controller-{job_id}")
    files = {
        "etcd_ca_file": str(ca.pem),
        "etcd_cert_file": str(client.cert),
        "etcd_key_file": str(client.key),
        **tls,
    }
    controller = {"tick_s": 0.02, "journal": cluster.url(f"/{job_id}"), **files}
    sections = {
        "job": {"id": job_id},
        "timeouts": {"heartbeat_interval_s": 0.2, "heartbeat_s": 10.0, "quorum_s": 30.0},
        "controller": {k: v for k, v in controller.items() if v},
        "roles.policy": {"min_replicas": 1, "n_init_replicas": 2},
    }
    return write_job_toml(tmp / "job.toml", sections), job_id


def test_a_leader_and_a_standby_journal_follow_and_fail_over_over_tls(
    tls_etcd: tuple[Cluster, CA, Path], procs: Procs, tmp_path: Path
) -> None:
    cluster, ca, _ = tls_etcd
    assert cluster.url().startswith("etcds://")
    config, _ = job_config(tmp_path, cluster, ca)
    spawn_env = {**child_env(), env.TOKEN: uuid.uuid4().hex}
    first = Controller(procs, tmp_path / "c1", config, env=spawn_env).start(timeout=120)
    second = Controller(procs, tmp_path / "c2", config, env=spawn_env).start(timeout=120)
    assert second.get("/healthz").json()["role"] == "standby"
    assert first.status()["journal"]["where"].startswith("etcds://")
    urls = f"{first.url},{second.url}"
    reps = [Replica(procs, urls, n, 0.05, spawn_env) for n in "ab"]
    for rep in reps:
        rep.wait_line(lambda x: x["step"] >= 3, 240, "a few steps")
    first.kill(signal.SIGKILL)
    wait_for(lambda: second.get("/healthz").json().get("role") == "leader", 60, "the takeover")
    after = max(rep.last()["step"] for rep in reps)  # type: ignore[index]
    for rep in reps:
        rep.wait_line(lambda x, s=after: x["step"] >= s + 3, 120, "steps under the new leader")
    assert second.status()["controllers"]["failovers"] == 1
    check_rounds([rep.lines() for rep in reps])
    quorums_agree(reps)


CONTROLLER = [sys.executable, "-m", "phalanx.cli", "controller"]


def controller_fails(config: Path, state: Path) -> str:
    """Start a controller on ``config`` that must not start; its one-line error (a
    config's errors too: the file, then each problem, on one line)."""
    p = subprocess.run(
        [*CONTROLLER, "--config", str(config), "--state-dir", str(state), "--port", "0"],
        capture_output=True,
        text=True,
        env={**child_env(), env.TOKEN: "t" * 32},
        timeout=120,
    )
    assert p.returncode != 0, p.stdout + p.stderr
    err = p.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_tls_mistakes_are_refused_in_one_line(
    tls_etcd: tuple[Cluster, CA, Path], tmp_path: Path
) -> None:
    cluster, ca, d = tls_etcd
    # No client certificate: etcd refuses the handshake.
    config, _ = job_config(tmp_path, cluster, ca, etcd_cert_file="", etcd_key_file="")
    err = controller_fails(config, tmp_path / "s1")
    assert "must name an etcd that answers" in err and cluster.url() in err, err
    assert "client certificate" in err and "controller.etcd_cert_file" in err, err
    # A certificate from another CA.
    other = CA(tmp_path / "other", name="another CA").client("stranger")
    config, _ = job_config(
        tmp_path, cluster, ca, etcd_cert_file=str(other.cert), etcd_key_file=str(other.key)
    )
    err = controller_fails(config, tmp_path / "s2")
    assert "must name an etcd that answers" in err and "client certificate" in err, err
    # etcd's certificate checked against a CA that did not sign it.
    config, _ = job_config(tmp_path, cluster, ca, etcd_ca_file=str(tmp_path / "other" / "ca.pem"))
    err = controller_fails(config, tmp_path / "s2b")
    assert "its TLS certificate is not trusted here: set controller.etcd_ca_file" in err, err
    # A CA file that is not there.
    config, _ = job_config(tmp_path, cluster, ca, etcd_ca_file=str(d / "nope.pem"))
    err = controller_fails(config, tmp_path / "s3")
    assert f"controller.etcd_ca_file {d / 'nope.pem'} cannot be read (no such file)" in err, err
    # TLS files with a plain etcd:// journal, and a certificate without its key.
    plain = cluster.url("/x").replace("etcds://", "etcd://")
    bad = write_job_toml(
        tmp_path / "plain.toml",
        {"job": {"id": "p"}, "controller": {"journal": plain, "etcd_ca_file": str(ca.pem)}},
    )
    err = controller_fails(bad, tmp_path / "s4")
    assert "controller.etcd_ca_file applies to an etcd journal over TLS" in err, err
    half = write_job_toml(
        tmp_path / "half.toml",
        {
            "job": {"id": "h"},
            "controller": {"journal": cluster.url("/h"), "etcd_cert_file": str(ca.pem)},
        },
    )
    err = controller_fails(half, tmp_path / "s5")
    assert "controller.etcd_cert_file needs controller.etcd_key_file too" in err, err
