"""``controller.journal``: "sqlite" (the default) or an etcd URL, refused in one line
when it is neither; the etcd key prefix defaults to one per job id."""

from __future__ import annotations

import re

import pytest

from phalanx.config import ConfigError, load_config
from phalanx.config.journal import EtcdTarget, parse_etcd


def test_the_default_journal_is_sqlite():
    assert load_config().controller.journal == "sqlite"


@pytest.mark.parametrize(
    ("url", "endpoints", "prefix"),
    [
        ("etcd://127.0.0.1:2379", (("127.0.0.1", 2379),), None),
        ("etcd://a:1,b.example:2/x/y", (("a", 1), ("b.example", 2)), "/x/y"),
        ("etcd://[::1]:2379/p/", (("::1", 2379),), "/p"),
    ],
)
def test_an_etcd_url_names_its_endpoints_and_prefix(url, endpoints, prefix):
    assert load_config(overrides=["--controller.journal", url]).controller.journal == url
    assert parse_etcd(url) == EtcdTarget(endpoints, prefix)


def test_the_prefix_defaults_to_one_per_job():
    target = parse_etcd("etcd://h:1")
    assert target.prefix_for("job-a") == "/phalanx/job-a" != target.prefix_for("job-b")
    assert parse_etcd("etcd://h:1/mine").prefix_for("job-a") == "/mine"
    assert parse_etcd("etcd://[::1]:1,h:2/p").url() == "etcd://[::1]:1,h:2/p"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis://x:1", "which is neither sqlite nor an etcd:// or etcds:// URL"),
        ("etcd://", "which names no host:port"),
        ("etcd://host", "whose endpoint 'host' is not host:port"),
        ("etcd://host:0", "whose endpoint 'host:0' is not host:port"),
        ("etcd://a:1,:2", "whose endpoint ':2' is not host:port"),
        ("etcd://a b:1", "whose host 'a b' is not a host name or address"),
        ("etcd://a:1/has space", "whose prefix '/has space' is not /name"),
    ],
)
def test_a_bad_journal_is_refused_in_one_line(url, why):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["--controller.journal", url])
    msg = str(e.value)
    assert re.search(r'controller\.journal must be "sqlite" or "etcd://', msg), msg
    assert f"got {url!r}, {why}" in msg, msg
    assert msg.count("\n") <= 1, msg


def test_etcds_is_an_etcd_over_tls_with_the_controllers_files():
    from phalanx.config.journal import target_of

    cfg = load_config(
        overrides=[
            *("--controller.journal", "etcds://h:2379/p"),
            *("--controller.etcd_ca_file", "/ca.pem"),
            *("--controller.etcd_cert_file", "/c.pem", "--controller.etcd_key_file", "/c.key"),
        ]
    ).controller
    t = target_of(cfg)
    assert t.tls and t.scheme == "https" and t.url() == "etcds://h:2379/p"
    assert t.verify() == "/ca.pem" and t.client_cert() == ("/c.pem", "/c.key")
    plain = parse_etcd("etcd://h:1")
    assert not plain.tls and plain.verify() is True and plain.client_cert() is None


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (
            ["--controller.journal", "etcd://h:1", "--controller.etcd_ca_file", "/ca.pem"],
            "controller.etcd_ca_file applies to an etcd journal over TLS: got "
            "controller.journal = 'etcd://h:1'. Write the journal as etcds://host:port",
        ),
        (
            ["--controller.journal", "etcds://h:1", "--controller.etcd_key_file", "/k"],
            "controller.etcd_key_file needs controller.etcd_cert_file too",
        ),
        (
            ["--controller.journal", "etcdx://h:1"],
            "which is neither sqlite nor an etcd:// or etcds:// URL",
        ),
    ],
)
def test_etcd_tls_mistakes_are_one_line(overrides, why):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert why in str(e.value) and "Traceback" not in str(e.value)
