"""The control plane over HTTPS: a CA and server certificates made here
(:mod:`certs`), a real controller serving TLS, a real FT-DDP job whose launcher,
replicas and status poller all verify it against ``--ca-file``, and the ways a
certificate can be wrong (another host's, another CA's, none trusted), each one
line at once, never a traceback or a retry until a deadline.

Every certificate names 127.0.0.1 or 10.255.255.1; traffic only ever goes to
127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from certs import CA, ServerCert
from procs import PROGRESS_S, Procs, child_env, wait_for

from phalanx import env
from phalanx.jobs.base import EXIT_UNRECOVERABLE

EXAMPLE = Path(__file__).parents[2] / "examples" / "ft_mlp.toml"
SHORT = ["--train.steps", "10"]
"""The job's overrides: a few steps are enough to cross the control plane many times."""


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CA:
    return CA(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def local_cert(ca: CA) -> ServerCert:
    return ca.server("local", "127.0.0.1")


def clean_env() -> dict[str, str]:
    """A child's environment with no CA file or advertised address of the caller's."""
    e = child_env()
    e.pop(env.CA_FILE, None)
    e.pop(env.ADVERTISE_HOST, None)
    return e


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "phalanx.cli", *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=PROGRESS_S,  # a bound on a loaded machine; each answers in moments
    )


def serve(procs: Procs, state: Path, *args: str) -> tuple[str, Path]:
    """Start ``phalanx controller`` on ``state`` and wait for its announced URL; returns
    (URL, its stderr file)."""
    cmd = [sys.executable, "-m", "phalanx.cli", "controller", "--config", str(EXAMPLE)]
    p, out, err = procs.spawn([*cmd, *SHORT, "--state-dir", str(state), *args], "ctl", clean_env())

    def announced() -> str | None:
        assert p.poll() is None, f"controller exited with {p.returncode}: {err.read_text()}"
        m = re.search(r" at (https?://\S+)", out.read_text())
        return m.group(1) if m else None

    url = wait_for(announced, PROGRESS_S, "the controller to announce its URL")
    assert (state / "url").read_text().strip() == url
    return url, err


def tls_args(cert: ServerCert) -> list[str]:
    return ["--tls-cert", str(cert.cert), "--tls-key", str(cert.key)]


def one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a command that failed, as an operator sees it."""
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


def run_job(run: Path, cert: ServerCert, ca: CA, *args: str) -> subprocess.CompletedProcess[str]:
    """``phalanx run`` of the short FT job over HTTPS, clients trusting ``ca``."""
    cmd = ["run", str(EXAMPLE), "--plain", "--json", "--run-dir", str(run), *SHORT, *args]
    return cli(*cmd, *tls_args(cert), "--ca-file", str(ca.pem))


def summary(p: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return data


def test_ft_job_runs_over_https(tmp_path: Path, ca: CA, local_cert: ServerCert, procs: Procs):
    run = tmp_path / "run"
    state = run / "controller"
    p = run_job(run, local_cert, ca, "--replicas", "2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = summary(p)
    assert s["ok"] and s["error"] is None and s["steps"] == 10, s
    url = (state / "url").read_text().strip()
    assert re.fullmatch(r"https://127\.0\.0\.1:\d+", url), url
    assert f"controller at {url}" in p.stdout
    log = (run / "controller.log").read_text()
    assert "clear text" not in log and "Traceback" not in log, log

    # The job's controller, back on its state dir over HTTPS: its status through the CA.
    url, err = serve(procs, state, *tls_args(local_cert))
    assert url.startswith("https://127.0.0.1:")
    st = cli("status", "--controller", str(state), "--ca-file", str(ca.pem), "--json")
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["roles"]["policy"]["step"] == 10
    # Plain HTTP to the same port gets no answer.
    with pytest.raises(httpx.TransportError):
        httpx.get(url.replace("https://", "http://") + "/healthz", timeout=30)
    # A client that does not trust the CA refuses the controller, in one line.
    line = one_line_error(cli("status", "--controller", str(state)))
    assert f"controller at {url}: its TLS certificate does not match (" in line, line
    assert "certificate names 127.0.0.1" in line, line
    assert err.read_text() == "", err.read_text()


def test_a_certificate_for_another_host_is_one_line_at_once(tmp_path: Path, ca: CA, procs: Procs):
    """A certificate the CA signed, but for 10.255.255.1: the controller at 127.0.0.1
    is refused by ``phalanx status`` and by ``phalanx run`` (whose launcher checks its
    own controller first), each in one line naming the host."""
    elsewhere = ca.server("elsewhere", "10.255.255.1")
    url, _ = serve(procs, tmp_path / "state", *tls_args(elsewhere))
    line = one_line_error(
        cli("status", "--controller", str(tmp_path / "state"), "--ca-file", str(ca.pem))
    )
    assert line.startswith(f"phalanx: controller at {url}: its TLS certificate does not match")
    assert "IP address mismatch" in line and "certificate names 127.0.0.1" in line, line
    # A replica stops at once too, with the exit code that tells a launcher a restart
    # cannot help.
    cmd = ["replica", "--config", str(EXAMPLE), "--name", "r", "--ca-file", str(ca.pem)]
    r = cli(*cmd, "--controller", str(tmp_path / "state"))
    assert r.returncode == EXIT_UNRECOVERABLE and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"phalanx replica r: {line.split(': ', 1)[1]}"

    p = run_job(tmp_path / "run", elsewhere, ca)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    s = summary(p)
    assert "its TLS certificate does not match" in s["error"], s
    assert "IP address mismatch" in s["error"] and s["steps"] == 0, s
    assert "restarting" not in p.stdout and "Traceback" not in p.stderr


def test_another_cas_certificate_is_refused(tmp_path: Path, ca: CA, procs: Procs):
    """A certificate for the right host, signed by a CA the client was not given."""
    stranger = CA(tmp_path / "other", "another CA").server("stranger", "127.0.0.1")
    url, _ = serve(procs, tmp_path / "state", *tls_args(stranger))
    line = one_line_error(
        cli("status", "--controller", str(tmp_path / "state"), "--ca-file", str(ca.pem))
    )
    assert f"controller at {url}: its TLS certificate does not match (certificate" in line


def test_controller_refuses_tls_files_it_cannot_use(tmp_path: Path, ca: CA, local_cert):
    """A missing certificate, or the key of another certificate: one line, exit 1,
    and the state dir untouched."""
    other = ca.server("other", "127.0.0.1")
    state = tmp_path / "state"
    base = ["controller", "--config", str(EXAMPLE), "--state-dir", str(state)]
    line = one_line_error(cli(*base, "--tls-cert", str(tmp_path / "no.pem"), "--tls-key", "k"))
    assert line == (
        f"phalanx: --tls-cert must be a readable PEM file: got '{tmp_path / 'no.pem'}' "
        f"(No such file or directory)."
    )
    line = one_line_error(
        cli(*base, "--tls-cert", str(local_cert.cert), "--tls-key", str(other.key))
    )
    assert line.startswith("phalanx: --tls-key must be the private key of --tls-cert: got ")
    assert not state.exists()


def test_wildcard_bind_advertises_a_reachable_url_and_warns_once(tmp_path: Path, procs: Procs):
    """``--host 0.0.0.0`` without TLS: one warning line, and the URL the operator
    advertised (here loopback, so that nothing leaves this machine), not 0.0.0.0."""
    state = tmp_path / "state"
    url, err = serve(procs, state, "--host", "0.0.0.0", "--advertise-host", "127.0.0.1")
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
    st = cli("status", "--controller", str(state), "--json")
    assert st.returncode == 0, st.stderr
    lines = err.read_text().splitlines()
    assert len(lines) == 1 and "clear text" in lines[0] and "--tls-cert" in lines[0], lines


def test_agent_serves_its_controller_over_https_and_restarts_it_on_the_same_url(
    tmp_path: Path, ca: CA, local_cert: ServerCert, procs: Procs
):
    """``phalanx agent --serve-controller`` with the controller's own bind and TLS
    options: the controller serves HTTPS at the port asked for, and SIGKILLed it is
    back at the same https URL, which ``phalanx status`` verifies against the CA."""
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "phalanx.cli", "agent", "--serve-controller"]
    cmd += ["--controller", str(state), "--config", str(EXAMPLE), "--ca-file", str(ca.pem)]
    cmd += ["--run-dir", str(tmp_path / "agent"), "--controller-host", "127.0.0.1"]
    cmd += ["--controller-port", "0", *tls_args(local_cert)]
    agent, out, err = procs.spawn(cmd, "agent", clean_env())

    def event(pred: Any, what: str) -> dict[str, Any]:
        def seen() -> dict[str, Any] | None:
            assert agent.poll() is None, f"agent exited {agent.returncode}: {err.read_text()}"
            for line in out.read_text().splitlines():
                e = json.loads(line)
                if pred(e):
                    return dict(e)
            return None

        return wait_for(seen, PROGRESS_S, what)

    try:
        first = event(lambda e: e["event"] == "controller", "the served controller")
        url = first["url"]
        assert re.fullmatch(r"https://127\.0\.0\.1:\d+", url), url
        st = cli("status", "--controller", str(state), "--ca-file", str(ca.pem), "--json")
        assert st.returncode == 0 and json.loads(st.stdout)["epoch"] == 1, st.stderr
        os.kill(first["pid"], signal.SIGKILL)
        event(
            lambda e: e["event"] == "controller_restart" and f"back at {url}" in e["note"],
            "the controller back at the same URL",
        )
        st = cli("status", "--controller", str(state), "--ca-file", str(ca.pem), "--json")
        assert st.returncode == 0 and json.loads(st.stdout)["epoch"] == 2, st.stderr
        agent.send_signal(signal.SIGTERM)  # it stops the controller it serves
        assert agent.wait(timeout=PROGRESS_S) == 128 + signal.SIGTERM
    finally:
        # The controller leads a session of its own: the group kill of the agent at
        # cleanup does not reach it; kill every one it started by pid.
        for e in map(json.loads, out.read_text().splitlines()):
            if e["event"].startswith("controller") and e.get("pid"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(e["pid"], signal.SIGKILL)


def test_agent_refuses_controller_options_it_cannot_use(tmp_path: Path, local_cert: ServerCert):
    """The served controller's options are checked by the agent, each in one line:
    without ``--serve-controller``, a port out of range, a certificate it cannot read."""
    base = ["agent", "--controller", str(tmp_path / "state"), "--config", str(EXAMPLE)]
    line = one_line_error(cli(*base, "--name", "r0", "--controller-port", "7000"))
    assert line == (
        "phalanx agent: --controller-port set up the controller the agent serves: pass "
        "--serve-controller too, or drop them."
    )
    line = one_line_error(cli(*base, "--serve-controller", "--controller-port", "70000"))
    assert line == (
        "phalanx agent: --controller-port must be a TCP port, 0 to 65535 (0 picks a free "
        "one): got 70000."
    )
    line = one_line_error(
        cli(*base, "--serve-controller", "--tls-cert", str(tmp_path / "no.pem"), "--tls-key", "k")
    )
    assert line.startswith("phalanx agent: --tls-cert must be a readable PEM file: got ")
    assert not (tmp_path / "state").exists()
