"""A replica given several controller URLs talks to the one that answers: the list
is how replicas and CLI tools follow the leader among several controllers."""

from __future__ import annotations

import pytest

from phalanx.client import ControllerClient
from phalanx.client.transport import ControllerError, ControllerUnreachable, Transport
from phalanx.net import free_port
from phalanx.protocol.base import Health


def test_a_list_whose_first_controller_is_down_reaches_the_next(start_controller):
    ctl = start_controller(n_init=1)
    dead = f"http://127.0.0.1:{free_port()}"
    c = ControllerClient(f"{dead}, {ctl.url}/", "policy", "a", token=ctl.token)
    try:
        assert c.url == dead  # the list's order is kept: the first is tried first
        c.register()
        q = c.quorum(step=0, timeout_s=30)
        assert q.replica_ids == [c.replica_id]
        assert c.url == ctl.url
        assert c.transport.urls == [dead, ctl.url]
        assert c.transport.leader_changes == 1  # moved once, then stayed
    finally:
        c.close()


def test_a_list_of_dead_controllers_is_unreachable_naming_every_url():
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    t = Transport(",".join(urls), token="t", unreachable_timeout_s=0.3)
    try:
        with pytest.raises(ControllerUnreachable, match="controllers at " + ", ".join(urls)):
            t.call("/healthz", None, Health)
    finally:
        t.close()


@pytest.mark.parametrize("bad", ["http://a:1,", "http://a:1,b:2", "http://a:1,ftp://b"])
def test_a_list_with_an_entry_that_is_not_a_url_is_refused_in_one_line(bad):
    with pytest.raises(ControllerError, match="comma-separated list") as e:
        Transport(bad, token="t")
    assert "\n" not in str(e.value)


def test_a_call_without_retries_still_tries_every_controller_of_the_list_once(
    start_controller,
):
    ctl = start_controller(n_init=1)
    dead = f"http://127.0.0.1:{free_port()}"
    t = Transport(f"{dead},{ctl.url}", token=ctl.token, unreachable_timeout_s=0.0)
    try:
        assert t.call("/healthz", None, Health).ok
        assert t.url == ctl.url
    finally:
        t.close()
