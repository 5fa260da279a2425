"""The dashboard in a real browser (Debian's chromium driven by Playwright, no browser
download) against a running RL job: the launcher with stand-in replicas (see
test_rl_launch.py), a real controller and real processes. A replica is SIGKILLed;
the page must show it evicted and its new incarnation. Screenshots go to
``test-artifacts/dashboard/``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from procs import child_env, wait_for
from test_rl_launch import fake_job

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the dev extra installs it
    sync_playwright = None  # type: ignore[assignment]

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium: `make install` installs Debian's chromium as root with apt-get",
    ),
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (dev extra)"),
    pytest.mark.timeout(150),
]

LEDGER_KEYS = ("prompts_leased", "prompts_done", "rollouts_pending", "rollouts_trained")


def _cli_status(state: Path) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "status", "--json", "--controller", str(state)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_dashboard_follows_a_job_through_a_kill(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.delenv("PHALANX_TOKEN", raising=False)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    job = fake_job(tmp_path, {"policy": 1, "rollout": 2}, steps=150, target=None)
    state = tmp_path / "run" / "controller"
    errors: list[BaseException] = []
    console: list[str] = []

    def browse() -> None:
        try:
            wait_for(lambda: (state / "url").exists() and (state / "token").exists(), 30, "url")
            url = (state / "url").read_text().strip()
            token = (state / "token").read_text().strip()
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
                # The page's CSP forbids eval, which polling wait_for_function needs.
                page = browser.new_page(viewport={"width": 1300, "height": 1600}, bypass_csp=True)
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
                # 1. The token from the URL fragment (never sent to the server).
                page.goto(f"{url}/#token={token}")
                page.wait_for_selector("#app:not([hidden])")
                assert "token" not in page.url
                # 2. Replicas of both roles.
                for role, n in (("policy", 1), ("rollout", 2)):
                    page.wait_for_function(
                        f"document.querySelectorAll('table[data-role={role}] "
                        f"tr[data-state=active]').length >= {n}",
                        timeout=30_000,
                    )
                page.screenshot(path=str(ARTIFACTS / "1-running.png"))
                # 3. SIGKILL a rollout replica: evicted on the page, then a new incarnation.
                victim = job.replicas["rollout-1"]
                wait_for(lambda: victim.proc is not None, 10, "rollout-1 to run")
                assert victim.proc is not None
                old = next(
                    r["replica_id"]
                    for r in job.status()["overview"]["roles"]["rollout"]["replicas"]
                    if r["name"] == "rollout-1"
                )
                os.kill(victim.proc.pid, signal.SIGKILL)
                page.wait_for_selector(
                    f"table[data-role=rollout] tr[data-state=evicted][data-replica='{old}']",
                    timeout=30_000,
                )
                page.wait_for_function(
                    "(old) => [...document.querySelectorAll('table[data-role=rollout] "
                    "tr[data-state=active]')].some(r => r.dataset.replica.startsWith('rollout-1:')"
                    " && r.dataset.replica !== old)",
                    arg=old,
                    timeout=30_000,
                )
                page.screenshot(path=str(ARTIFACTS / "2-after-kill.png"))
                # 4. The step advances and the charts have points.
                step0 = int(page.inner_text("[data-k=step] b"))
                page.wait_for_function(
                    f"Number(document.querySelector('[data-k=step] b').textContent) > {step0}"
                )
                page.wait_for_function(
                    "Number(document.getElementById('chart-reward').dataset.points) > 1 && "
                    "Number(document.getElementById('chart-exact_match').dataset.points) > 1"
                )
                # Actions ask first: cancelling an eviction changes nothing.
                page.click("table[data-role=policy] tr[data-state=active] button:text('evict')")
                page.wait_for_selector("#confirm[open]")
                page.click("#confirm-cancel")
                assert job.status()["overview"]["roles"]["policy"]["replicas"]
                # 5. The ledger as `phalanx status --json` says it. Stop the rollout
                # replicas (scale to 0) so that it holds still, compare, scale back.
                auth = {"Authorization": f"Bearer {token}"}
                body = {"role": "rollout", "replicas": 0}
                assert httpx.post(url + "/v1/scale", json=body, headers=auth).status_code == 200
                cli: dict = {}

                def settled() -> bool:
                    nonlocal cli
                    before, cli = cli, _cli_status(state)
                    still = not cli["overview"]["roles"]["rollout"]["replicas"]
                    return (
                        still
                        and before.get("overview", {}).get("ledger") == (cli["overview"]["ledger"])
                    )

                wait_for(settled, 30, "the ledger to hold still", interval=0.5)
                page.wait_for_timeout(2500)  # at least one more stream event
                shown = {k: int(page.inner_text(f"[data-k={k}] b")) for k in LEDGER_KEYS}
                ledger = cli["overview"]["ledger"]
                assert shown == {k: ledger[k] for k in LEDGER_KEYS}
                assert ledger["prompts_done"] + ledger["rollouts_trained"] > 0
                body = {"role": "rollout", "replicas": 2}
                assert httpx.post(url + "/v1/scale", json=body, headers=auth).status_code == 200
                page.screenshot(path=str(ARTIFACTS / "3-finished.png"), full_page=True)
                browser.close()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=browse, daemon=True)
    t.start()
    assert job.run(live=False, as_json=True) == 0
    t.join(60)
    assert not errors, errors
    # 6. No errors in the browser's console.
    assert console == [], console
