import pytest

from phalanx.launch.local import Chaos


def test_chaos_parses_its_options():
    c = Chaos.parse("kill-every=10,restart-after=1.5,seed=3")
    assert (c.kill_every_s, c.restart_after_s, c.seed) == (10.0, 1.5, 3)
    assert Chaos.parse("kill-every=2").restart_after_s == 2.0


@pytest.mark.parametrize("text", ["kill-every", "every=3", "kill-every=x", "kill-every=0", "kill-every=1,foo=2"])
def test_bad_chaos_is_refused_with_the_expected_form(text):
    with pytest.raises(ValueError, match="--chaos"):
        Chaos.parse(text)
