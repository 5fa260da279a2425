"""The dashboard in a real browser (Debian's chromium driven by Playwright, no browser
download) against the real RL main job: ``phalanx run examples/sort_grpo.toml``, as
``make demo`` runs it, shrunk by config overrides (a 1-layer model, 4 prompts x 4
samples per batch) so that it starts and trains fast on 2 cores. A controller, one
policy and two rollout replicas, all real processes.

The test opens the dashboard URL the launcher prints, SIGKILLs a rollout replica (by
the pid its ``start`` line gives) and follows the page: both roles' replicas, the
eviction and the new incarnation, the step, the charts, and the ledger, which must
show exactly the numbers of ``phalanx status --json`` once the job holds still (the
rollout role scaled to 0 from the page itself). The browser console must stay free
of errors. The job is then stopped as Ctrl-C stops it. Screenshots go to
``test-artifacts/dashboard/``."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from etcd_server import etcd  # noqa: F401  (a module-scoped fixture)
from procs import Procs, cli_status, wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sort_grpo.toml"
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# The main job, smaller and without an end of its own (the test stops it): ~15k
# parameters, 4 prompts x 4 samples per batch, generation paced at 0.05 s per prompt
# so that the job leaves the browser some of the 2 cores.
SHRINK = [
    *("--rl.model.hidden_size", "32", "--rl.model.num_layers", "1"),
    *("--rl.model.num_heads", "2", "--rl.model.intermediate_size", "64"),
    *("--rl.grpo.prompts_per_step", "4", "--rl.grpo.group_size", "4"),
    *("--rl.grpo.inner_epochs", "1", "--rl.grpo.steps", "1000000"),
    *("--rl.loop.prompts_per_lease", "2", "--rl.loop.sync_every", "1"),
    *("--rl.loop.window", "2", "--rl.loop.target_exact_match=null"),
    *("--rl.loop.gen_delay_s", "0.05"),
]

try:
    from playwright.sync_api import Page, sync_playwright
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # pragma: no cover - the dev extra installs it
    sync_playwright = None  # type: ignore[assignment]

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium: `make install` installs Debian's chromium as root with apt-get",
    ),
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (dev extra)"),
]


def _ask(page: Page, button: str, tries: int = 6) -> None:
    """Click ``button`` until the confirmation dialog opens. The page re-renders its
    tables from each status poll; on a loaded machine a click can land as the row it
    aimed at is replaced, and then nothing opens: click again, as a user would."""
    for i in range(tries):
        page.click(button)
        try:
            page.wait_for_selector("#confirm[open]", timeout=10_000)
            return
        except PlaywrightTimeout:
            if i == tries - 1:
                raise


def _starts(log: Path) -> list[dict[str, Any]]:
    """The ``start`` lines of a replica's incarnations, from its log in the run dir."""
    lines = log.read_text().split("\n")[:-1] if log.exists() else []
    return [e for x in lines if x.startswith("{") for e in [json.loads(x)] if e["event"] == "start"]


def _ledger_cards(ledger: dict[str, Any]) -> dict[str, str]:
    """What the page's ledger cards must read for the ``overview.ledger`` of a status."""
    discarded = ledger["rollouts_discarded"]
    keys = ("prompts_leased", "prompts_done", "prompts_trained", "rollouts_pending")
    return {
        **{k: str(ledger[k]) for k in (*keys, "rollouts_trained")},
        "rollouts_discarded": str(sum(discarded.values())),
        **{f"discarded_{why}": str(n) for why, n in discarded.items()},
        "ok": "balanced" if ledger["ok"] else "UNBALANCED",
    }


def _shown(page: Page) -> dict[str, str]:
    return page.evaluate(
        "() => Object.fromEntries([...document.querySelectorAll('#ledger [data-k]')]"
        ".map((c) => [c.dataset.k, c.querySelector('b').textContent]))"
    )


def _still(state: Path) -> dict[str, Any]:
    """``phalanx status --json`` once the job holds still: no rollout replica left and
    the ledger and step the same in two reads half a second apart."""
    last: dict[str, Any] = {}

    def same() -> dict[str, Any] | None:
        nonlocal last
        prev, last = last, cli_status(state)
        ov = last["overview"]
        if ov["roles"]["rollout"]["replicas"] or not prev:
            return None
        before = prev["overview"]
        return (
            last
            if (before["ledger"], before["job"]["step"]) == (ov["ledger"], ov["job"]["step"])
            else None
        )

    return wait_for(same, 60, "the job to hold still", interval=0.5)


def test_dashboard_follows_the_main_job_through_a_kill(tmp_path: Path, procs: Procs):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    run = tmp_path / "run"
    state = run / "controller"
    cmd = [sys.executable, "-m", "phalanx.cli", "run", str(EXAMPLE), "--plain", "--json"]
    launcher, out, err = procs.spawn([*cmd, "--run-dir", str(run), *SHRINK], "launcher")
    console: list[str] = []
    try:
        # The launcher prints the dashboard's URL first thing, the token in the fragment.
        def printed() -> str | None:
            assert launcher.poll() is None, f"phalanx run exited:\n{err.read_text()[-3000:]}"
            m = re.search(r"dashboard: (\S+)", out.read_text())
            return m.group(1) if m else None

        dashboard = wait_for(printed, 60, "phalanx run to print the dashboard URL")
        url = (state / "url").read_text().strip()
        assert dashboard == f"{url}/#token={(state / 'token').read_text().strip()}"
        assert "?" not in dashboard

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1300, "height": 1600}, bypass_csp=True)
            page.set_default_timeout(60_000)
            page.on(
                "console",
                lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error" else None,
            )
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            # Without a token: only the prompt.
            page.goto(url + "/")
            page.wait_for_selector("#token-prompt:not([hidden])")
            assert page.is_hidden("#app")
            page.screenshot(path=str(ARTIFACTS / "0-token-prompt.png"))

            # 1. The page loads with the token from the printed URL's fragment, which it
            # then drops from the address bar.
            page.goto(dashboard)
            page.wait_for_selector("#app:not([hidden])")
            assert "token" not in page.url

            # 2. Replicas of both roles, active (a rollout replica once it holds weights).
            for role, n in (("policy", 1), ("rollout", 2)):
                page.wait_for_function(
                    f"document.querySelectorAll('table[data-role={role}] "
                    f"tr[data-state=active]').length >= {n}"
                )
            page.screenshot(path=str(ARTIFACTS / "1-running.png"))

            # 3. SIGKILL rollout-1 (the pid its start line printed): the page shows it
            # evicted, with the detector, then its new incarnation, active.
            (start,) = _starts(run / "rollout-1.log")
            old = start["replica"]
            os.kill(start["pid"], signal.SIGKILL)
            gone = f"table[data-role=rollout] tr[data-state=evicted][data-replica='{old}']"
            page.wait_for_selector(gone)
            # The dropped lifeline (or held heartbeat) as a rule. Before replicas held a
            # lifeline, a kill between two heartbeats was once caught only when the
            # launcher's restart registered ("replaced"); that detector stays valid.
            assert re.search(r"by (disconnect|heartbeat|replaced)", page.inner_text(gone))
            new = page.wait_for_function(
                "(old) => [...document.querySelectorAll('table[data-role=rollout] "
                "tr[data-state=active]')].map(r => r.dataset.replica).find(r => "
                "r.startsWith('rollout-1:') && r !== old)",
                arg=old,
            ).json_value()
            assert [e["replica"] for e in _starts(run / "rollout-1.log")] == [old, new]
            timeline = page.inner_text("#timeline")
            assert f"{old} evicted by" in timeline and f"{new} joined rollout" in timeline
            page.screenshot(path=str(ARTIFACTS / "2-after-kill.png"), full_page=True)

            # 4. The step advances and the charts have points.
            step0 = int(page.inner_text("[data-k=step] b"))
            page.wait_for_function(
                f"Number(document.querySelector('[data-k=step] b').textContent) > {step0}"
            )
            page.wait_for_function(
                "['loss', 'reward', 'exact_match'].every((c) => "
                "Number(document.getElementById(`chart-${c}`).dataset.points) > 1)"
            )

            # Actions ask first: cancelling an eviction changes nothing.
            policy = page.get_attribute(
                "table[data-role=policy] tr[data-state=active]", "data-replica"
            )
            _ask(page, "table[data-role=policy] tr[data-state=active] button:text('evict')")
            page.click("#confirm-cancel")
            page.wait_for_timeout(500)
            roles = cli_status(state)["overview"]["roles"]
            assert [r["replica_id"] for r in roles["policy"]["replicas"]] == [policy]

            # 5. The ledger as `phalanx status --json` says it. Scale the rollout role to
            # 0 from the page (the launcher stops both), so that the job holds still.
            head = "div.role:has(table[data-role=rollout]) h3"
            page.fill(f"{head} input", "0")
            _ask(page, f"{head} button:text('scale')")
            assert "Scale rollout to 0 replicas?" in page.inner_text("#confirm-text")
            page.click("#confirm-ok")
            page.wait_for_selector("#conn:text('done: Scale rollout to 0 replicas')")
            cli = _still(state)
            want = _ledger_cards(cli["overview"]["ledger"])
            assert int(want["prompts_trained"]) > 0 and want["prompts_leased"] == "0"
            try:
                wait_for(lambda: _shown(page) == want, 15, "the page to show the ledger")
            except AssertionError:
                assert _shown(page) == want  # the difference, if it never matched
            assert page.inner_text("[data-k=step] b") == str(cli["overview"]["job"]["step"])
            assert cli_status(state)["overview"]["ledger"] == cli["overview"]["ledger"]
            page.screenshot(path=str(ARTIFACTS / "3-ledger.png"), full_page=True)
            browser.close()

        # The job stops as Ctrl-C stops it: replicas and controller first, then the
        # summary, with the ledger balanced.
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 130, err.read_text()[-3000:]
        summary = json.loads(out.read_text().strip().splitlines()[-1])
        assert summary["event"] == "summary" and summary["error"] == "interrupted"
        assert summary["ledger_ok"] is True and summary["restarts"] >= 1
        notes = out.read_text().splitlines()
        first = next(i for i, x in enumerate(notes) if "dashboard: " in x)
        assert all(" batch " not in x for x in notes[:first]), notes[: first + 1]
        assert any("rollout-1 exited with -9; restarting" in x for x in notes)
        assert any("rollout-1: stopping (scale rollout to 0)" in x for x in notes)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)  # it stops its replicas and controller
            try:
                launcher.wait(60)
            except subprocess.TimeoutExpired:
                launcher.kill()
    # 6. No errors in the browser's console.
    assert console == [], console


def test_the_dashboard_follows_the_leader_controller(etcd, procs: Procs, tmp_path: Path):  # noqa: F811
    """Two controllers of one job on etcd. The dashboard opened at the standby's URL is
    sent to the leader's, and shows who leads; the leader SIGKILLed, the page moves to
    the new leader by itself (the token along) and shows the failover."""
    import uuid

    from procs import Controller, child_env, write_job_toml

    from phalanx import env

    job_id = f"dash-{uuid.uuid4().hex[:6]}"
    config = write_job_toml(
        tmp_path / "job.toml",
        {
            "job": {"id": job_id},
            "controller": {"journal": etcd.url(f"/{job_id}")},
            "roles.policy": {"min_replicas": 1, "n_init_replicas": 1},
        },
    )
    token = uuid.uuid4().hex
    spawn_env = {**child_env(), env.TOKEN: token}
    first = Controller(procs, tmp_path / "c1", config, env=spawn_env).start(timeout=120)
    second = Controller(procs, tmp_path / "c2", config, env=spawn_env).start(timeout=120)
    assert second.get("/healthz").json()["role"] == "standby"
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 900}, bypass_csp=True)
        page.set_default_timeout(60_000)
        page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
        page.goto(f"{second.url}/#token={token}")
        page.wait_for_selector("#app:not([hidden])")
        assert page.url.startswith(first.url), page.url  # sent to the leader's page
        shown = page.inner_text("[data-k=leader]")
        assert f"controller {first.url} leads" in shown and "0 failover(s)" in shown, shown
        assert second.url in shown  # the standby, listed
        page.screenshot(path=str(ARTIFACTS / "4-leader.png"))
        first.kill(signal.SIGKILL)
        # The page finds the controller gone, tries the other one, and stays there.
        page.wait_for_function(
            "document.querySelector('[data-k=leader]')?.textContent.includes('1 failover(s)')"
        )
        assert page.url.startswith(second.url), page.url
        assert f"controller {second.url} leads" in page.inner_text("[data-k=leader]")
        assert page.is_visible("#app") and "token" not in page.url
        page.screenshot(path=str(ARTIFACTS / "5-followed.png"))
        browser.close()
    assert errors == [], errors
