"""What a process advertises (:mod:`phalanx.net`): an operator's spec resolves to
an address peers can connect to, or is refused in one line."""

from __future__ import annotations

import ipaddress

import pytest

from phalanx import env
from phalanx.net import AddressError, advertise_for_bind, resolve, routable_host


def test_an_interface_spec_gives_its_ipv4_address():
    assert resolve("iface:lo") == "127.0.0.1"


def test_an_interface_that_does_not_exist_is_one_line():
    with pytest.raises(AddressError) as e:
        resolve("iface:nosuch")
    assert "'nosuch' does not exist" in str(e.value) and "'lo'" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec", ["0.0.0.0", "::"])
def test_a_wildcard_is_not_an_address_to_advertise(spec: str):
    with pytest.raises(AddressError, match="must be one peers can connect to"):
        resolve(spec)


def test_ips_are_taken_as_they_are():
    assert resolve("10.0.0.5") == "10.0.0.5"
    assert resolve(" ::1 ") == "::1"


def test_a_wildcard_bind_advertises_an_interface_address(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(env.ADVERTISE_HOST, raising=False)
    host = advertise_for_bind("0.0.0.0")
    assert host == routable_host()
    ip = ipaddress.ip_address(host)
    assert ip.version == 4 and not ip.is_unspecified
    assert advertise_for_bind("10.1.2.3") == "10.1.2.3"  # a named bind is itself


def test_the_operators_address_comes_first(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(env.ADVERTISE_HOST, "iface:lo")
    assert advertise_for_bind("0.0.0.0") == "127.0.0.1"
    monkeypatch.setenv(env.ADVERTISE_HOST, "0.0.0.0")
    with pytest.raises(AddressError):
        advertise_for_bind("0.0.0.0")
