#!/usr/bin/env python3
"""Open a training-lab ``report.html`` in Debian's headless Chromium and check every figure loads.

    python scripts/check_report.py runs/demo/report.html

The report marks each ``<img>`` with ``data-loaded="1"`` (or ``"0"``) from a load handler; this
script dumps the DOM after the page has loaded and fails when any figure did not load, when the
page has no figure, or when a marker is missing (the script did not run). Without a ``chromium``
binary it prints why and exits 0 (skipped): browsers cannot be downloaded by test tools here,
install Debian's package with ``apt-get install chromium``.

Exit codes: 0 = all figures loaded (or skipped), 1 = a figure failed, 2 = usage / browser error.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def dump_dom(browser: str, page: Path, timeout: float = 60.0) -> str:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            browser,
            "--headless",
            "--no-sandbox",  # root in a container
            "--disable-gpu",
            "--allow-file-access-from-files",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=10000",  # let the load event and its handler run
            "--dump-dom",
            page.resolve().as_uri(),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if res.returncode != 0 or "<html" not in res.stdout:
        raise RuntimeError(f"{browser} failed ({res.returncode}): {res.stderr.strip()[-500:]}")
    return res.stdout


def check(dom: str) -> tuple[list[str], list[str]]:
    """(loaded, failed) image sources from a dumped DOM."""
    loaded, failed = [], []
    for tag in re.findall(r"<img\b[^>]*>", dom):
        src = re.search(r'src="([^"]*)"', tag)
        name = src.group(1) if src else "?"
        mark = re.search(r'data-loaded="([01])"', tag)
        (loaded if mark and mark.group(1) == "1" else failed).append(name)
    return loaded, failed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="check_report.py",
        description="Open a training-lab report.html in headless Chromium and check that every "
        "figure loads. Exit codes: 0 = all figures loaded (or skipped: no chromium), "
        "1 = a figure failed, 2 = usage / browser error.",
    )
    parser.add_argument(
        "report", type=Path, help="the report.html to check, e.g. runs/demo/report.html"
    )
    try:
        page = parser.parse_args(argv).report
    except SystemExit as exc:  # --help exits 0, a usage error 2
        return int(exc.code or 0)
    if not page.is_file():
        print(f"error: {page} does not exist", file=sys.stderr)
        return 2
    browser = find_browser()
    if browser is None:
        print(f"SKIPPED: no chromium found ({', '.join(BROWSERS)}); apt-get install chromium")
        return 0
    try:
        dom = dump_dom(browser, page)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    loaded, failed = check(dom)
    if not loaded and not failed:
        print(f"FAIL: {page} has no figure")
        return 1
    for name in failed:
        print(f"FAIL: figure did not load: {name}")
    print(f"{len(loaded)}/{len(loaded) + len(failed)} figures loaded in {page}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
