"""The controller's TLS options and its advertised URL, without a network: a
certificate without its key (and the reverse) is refused in one line before
anything is touched, a controller reachable from other machines without TLS
warns in exactly one line, and the URL never names a wildcard address."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest

from phalanx import env
from phalanx.cli import main
from phalanx.cli_net import apply_env, check_advertised_bind
from phalanx.client.transport import certificate_mismatch
from phalanx.controller.tls import clear_text_warning, url_for, warn_if_clear_text

EXAMPLE = Path(__file__).parents[2] / "examples" / "ft_mlp.toml"


@pytest.mark.parametrize(
    ("flag", "missing"), [("--tls-cert", "--tls-key"), ("--tls-key", "--tls-cert")]
)
def test_controller_refuses_half_a_tls_pair_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, missing: str
):
    state = tmp_path / "state"
    code = main(["controller", "--state-dir", str(state), flag, str(tmp_path / "x.pem")])
    assert code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        f"phalanx: --tls-cert and --tls-key must be given together: got {flag} without {missing}."
    )
    assert not state.exists()  # refused before the state dir is made


def test_run_refuses_half_a_tls_pair_in_one_line(tmp_path: Path):
    with pytest.raises(SystemExit) as e:
        main(["run", str(EXAMPLE), "--run-dir", str(tmp_path / "run"), "--tls-cert", "c.pem"])
    assert str(e.value).startswith("phalanx run: --tls-cert and --tls-key must be given together")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_controller_beyond_loopback_without_tls_warns_in_exactly_one_line(
    host: str, capsys: pytest.CaptureFixture[str]
):
    warn_if_clear_text(host, tls=False)
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1, lines
    assert f"--host {host} " in lines[0] and "clear text" in lines[0]
    assert "--tls-cert and --tls-key" in lines[0]


@pytest.mark.parametrize(("host", "tls"), [("127.0.0.1", False), ("::1", False), ("0.0.0.0", True)])
def test_no_warning_on_loopback_or_with_tls(host: str, tls: bool):
    assert clear_text_warning(host, tls) is None


def test_the_url_of_a_wildcard_bind_is_the_advertised_address(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(env.ADVERTISE_HOST, "iface:lo")
    assert url_for("0.0.0.0", 8443, tls=True) == "https://127.0.0.1:8443"
    monkeypatch.delenv(env.ADVERTISE_HOST)
    url = url_for("0.0.0.0", 80, tls=False)
    assert url.startswith("http://") and "0.0.0.0" not in url
    assert "[::]" not in url_for("::", 80, tls=False)


def test_a_loopback_bind_keeps_its_address(monkeypatch: pytest.MonkeyPatch):
    """Only loopback reaches a controller bound there, whatever the environment says."""
    monkeypatch.setenv(env.ADVERTISE_HOST, "10.9.8.7")
    assert url_for("127.0.0.1", 5, tls=False) == "http://127.0.0.1:5"
    assert url_for("::1", 5, tls=True) == "https://[::1]:5"


def test_advertising_from_a_loopback_bind_is_refused():
    args = argparse.Namespace(host="127.0.0.1", advertise_host="10.0.0.5")
    with pytest.raises(SystemExit, match=r"--advertise-host must be an address the controller"):
        check_advertised_bind(args)
    check_advertised_bind(argparse.Namespace(host="0.0.0.0", advertise_host="10.0.0.5"))


def test_an_unreadable_ca_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(env.CA_FILE, "")  # apply_env sets it: restored after the test
    missing = tmp_path / "ca.pem"
    with pytest.raises(SystemExit) as e:
        apply_env(argparse.Namespace(ca_file=str(missing)), "status")
    assert str(e.value) == (
        f"phalanx status: --ca-file (${env.CA_FILE}) must be a readable PEM file of CA "
        f"certificates: got '{missing}' (No such file or directory). Pass the CA that signed "
        f"the controller's certificate."
    )
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    with pytest.raises(SystemExit, match=r"must be a readable PEM file of CA certificates"):
        apply_env(argparse.Namespace(ca_file=str(not_pem)), "status")


def test_other_transport_errors_are_not_certificate_mismatches():
    """A refused connection heals when the controller comes back: retried, not fatal."""
    assert certificate_mismatch("https://h:1", httpx.ConnectError("refused")) is None
