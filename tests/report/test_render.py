"""The report opens in a real browser (Debian's headless Chromium) with no network and renders.

In CI (``CI=true``) a missing Chromium is a failure, not a skip: `.ci/run` installs it.
"""
import os
import re
import shutil
import subprocess

import pytest

from residency.control.report import build_report
from tests.report.test_report import wedged

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,2000"]


def chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed: .ci/run must `apt-get install -y chromium` before the tests")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return path


def run_chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


def test_the_report_renders_in_headless_chromium_with_every_chart(tmp_path, L):
    wedged(L)
    html = build_report(L.events, "test")
    page = tmp_path / "report.html"
    page.write_text(html)
    dom = run_chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    # the inline script ran to its end, and found every chart the server drew
    assert 'data-rendered="1"' in dom, dom[-2000:]
    charts = re.search(r'data-charts="(\d+)"', dom)
    assert charts and int(charts.group(1)) == html.count('<svg class="plot') >= 10
    assert dom.count("<path") >= 10 and 'class="bar ongoing"' in dom

    shot = tmp_path / "report.png"
    run_chromium(tmp_path, f"--screenshot={shot}", page.as_uri())
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000   # a blank page compresses to a few KB
