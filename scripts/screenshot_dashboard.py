"""Take a screenshot of a running job's dashboard, for docs (``docs/img/``).

    python scripts/screenshot_dashboard.py --controller RUN_DIR/controller \\
        --out docs/img/dashboard-chaos.png --min-evictions 2

It opens the controller's page in Debian's chromium, driven by Playwright (no
browser download; ``executable_path`` is the system's ``chromium``), with the job
token in the URL fragment, and waits until the page shows what the picture is
for: at least ``--min-evictions`` evictions in the timeline, every evicted
replica back under a new incarnation, every live replica active, and at least
``--min-points`` points in every chart. The token comes from ``--token``, else
``$PHALANX_TOKEN``, else the controller's state dir (as for ``phalanx status``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from urllib.parse import quote

from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

from phalanx.client import find_token, resolve

READY = """([evictions, points]) => {
  const app = document.getElementById("app");
  if (!app || app.hidden) return false;
  const charts = [...document.querySelectorAll("svg[id^=chart-]")];
  if (!charts.length || charts.some((c) => Number(c.dataset.points || 0) < points)) return false;
  if (document.querySelectorAll("#timeline li.evict").length < evictions) return false;
  const live = [...document.querySelectorAll("table[data-role] tbody tr:not(.gone)")];
  if (!live.length || live.some((r) => r.dataset.state !== "active")) return false;
  const back = new Set(live.map((r) => r.dataset.replica.split(":")[0]));
  return [...document.querySelectorAll("tr.gone")].every(
    (r) => back.has(r.dataset.replica.split(":")[0]));
}"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--controller", required=True, help="the controller's URL or state dir")
    p.add_argument("--token", help="the job token (default: $PHALANX_TOKEN or the state dir)")
    p.add_argument("--out", required=True, help="where to write the PNG")
    p.add_argument("--width", type=int, default=1400, help="viewport width (1400)")
    p.add_argument("--height", type=int, default=900, help="viewport height (900)")
    p.add_argument("--full-page", action="store_true", help="the whole page, not the viewport")
    p.add_argument(
        "--min-evictions", type=int, default=0, help="evictions the timeline must show (0)"
    )
    p.add_argument("--min-points", type=int, default=2, help="points in every chart")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for all that")
    args = p.parse_args(argv)

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium must be installed: got none on PATH. apt-get install chromium")
    url, state_dir = resolve(args.controller)
    token = args.token or find_token(state_dir)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        # The page's CSP forbids eval, which wait_for_function needs.
        page = browser.new_page(
            viewport={"width": args.width, "height": args.height}, bypass_csp=True
        )
        page.goto(f"{url}/#token={quote(token, safe='')}")
        try:
            page.wait_for_function(
                READY, arg=[args.min_evictions, args.min_points], timeout=args.timeout * 1000
            )
        except PlaywrightTimeout:
            page.screenshot(path=args.out, full_page=args.full_page)
            raise SystemExit(
                f"the dashboard must show {args.min_evictions} evictions, every evicted "
                f"replica back, every replica active and {args.min_points} points per chart: "
                f"not within {args.timeout:.0f} s. What it showed is in {args.out}."
            ) from None
        page.wait_for_timeout(300)  # let the charts and timeline finish drawing
        page.screenshot(path=args.out, full_page=args.full_page)
        browser.close()
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
