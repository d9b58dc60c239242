"""A person's view: JupyterLab in headless Chromium shows the widget updating while a cell runs.

Starts JupyterLab on a free port with a token and a temporary root folder holding one notebook,
opens it in Debian's Chromium (driven by Playwright's Python package with that executable; no
browser download), runs a cell that loads the extension, connects to the test server and trains
for a few seconds, and reads the widget's counters from the page twice while the cell is still
running. A screenshot goes to test-artifacts/.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"

TRAIN_CELL = """\
%load_ext rgpu_jupyter
%rgpu connect
import time
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to("rgpu")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 16).to("rgpu"), torch.randn(64, 1).to("rgpu")
t0, step = time.time(), 0
while time.time() - t0 < 8:
    loss = (model(x) - y).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0:
        loss.item()
    step += 1
print("trained", step, "steps")
"""

pytestmark = [
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason=f"{CHROMIUM} is not installed (apt-get install chromium)",
    ),
    pytest.mark.timeout(180),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start_jupyterlab(tmp_path: Path, env: dict, notebook: str):
    """JupyterLab on a free port with a token, serving `tmp_path / "lab"`; yields the URL that
    opens `notebook`. Stopped (its whole process group) on exit."""
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **env,
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
    }
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
        f"--port={port}", "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={tmp_path / 'lab'}", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.news_url=None",
    ]  # fmt: skip
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log_text = (tmp_path / "jupyterlab.log").read_text()[-3000:]
                    raise RuntimeError("JupyterLab did not start:\n" + log_text) from None
                time.sleep(0.2)
        yield f"{base}/lab/tree/{notebook}?token={token}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture
def jupyterlab(server, tmp_path):
    """A JupyterLab server whose kernels reach the test rgpu server; yields the notebook's URL."""
    root = tmp_path / "lab"
    root.mkdir()
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(TRAIN_CELL)],
        metadata={
            "kernelspec": {
                "name": "python3",
                "display_name": "Python 3 (ipykernel)",
                "language": "python",
            }
        },
    )
    nbformat.write(nb, root / "live.ipynb")
    with start_jupyterlab(tmp_path, {**os.environ, "RGPU_SERVER": server.url}, "live.ipynb") as url:
        yield url


def _counters(page) -> tuple[str, int, int]:
    what = page.locator(".rgpu-live .rgpu-what").first.inner_text()
    messages = int(page.locator(".rgpu-live .rgpu-messages").first.inner_text())
    waits = int(page.locator(".rgpu-live .rgpu-waits").first.inner_text())
    return what, messages, waits


def _cell_running(page) -> bool:
    return "*" in page.locator(".jp-Cell .jp-InputPrompt").first.inner_text()


def _run_first_cell(page) -> None:
    """Ctrl+Enter in the first cell once the kernel is idle; again if the request got lost."""
    page.wait_for_function(
        "() => (document.querySelector('#jp-main-statusbar')?.innerText || '').includes('| Idle')",
        timeout=60_000,
    )
    prompt = page.locator(".jp-Cell .jp-InputPrompt").first
    for _ in range(3):
        page.locator(".jp-Cell .cm-content").first.click()
        page.keyboard.press("Control+Enter")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if prompt.inner_text().strip() not in ("[ ]:", ""):
                return
            page.wait_for_timeout(100)
    raise AssertionError("JupyterLab never started running the cell")


def test_widget_counters_move_while_the_cell_runs(jupyterlab):
    playwright = pytest.importorskip("playwright.sync_api")
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update"],
        )  # fmt: skip
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            page.goto(jupyterlab)
            page.wait_for_selector(".jp-Notebook .jp-Cell .cm-content", timeout=60_000)
            _run_first_cell(page)

            page.wait_for_selector(".rgpu-live .rgpu-messages", timeout=30_000)
            first = _counters(page)
            deadline = time.monotonic() + 20
            # the training loop has started: its first loss.item() has come back (the first
            # forward imports Dynamo for meta inference, seconds on a loaded machine)
            while first[0] != "running [1]" or first[2] == 0:
                assert time.monotonic() < deadline, first
                page.wait_for_timeout(100)
                first = _counters(page)
            assert _cell_running(page)
            page.wait_for_timeout(1500)
            second = _counters(page)
            still_running = _cell_running(page)
            page.screenshot(path=str(ARTIFACTS / "browser-widget-running.png"))
            assert still_running, "the cell ended before the second reading; train longer"
            assert second[0] == "running [1]"
            assert second[1] > first[1] and second[2] > first[2], (first, second)

            page.wait_for_selector("text=/trained \\d+ steps/", timeout=60_000)
            page.wait_for_timeout(500)  # one more refresh after the cell ends
            what, messages, waits = _counters(page)
            assert what == "last cell [1]" and messages >= second[1] and waits >= second[2]
            state = page.locator(".rgpu-live .rgpu-state").first.inner_text()
            assert state == "connected"
            assert re.search(r"\[1\]", page.locator(".rgpu-recent").first.inner_text())
            page.screenshot(path=str(ARTIFACTS / "browser-widget-done.png"))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser-failure.png"))
            raise
        finally:
            browser.close()
