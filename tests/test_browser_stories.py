"""A person's stories in real JupyterLab and Chromium: the widget, an interrupt, a kernel restart.

One notebook, one JupyterLab, one page; the stories run in order as a person would try them:

* the widget: `%rgpu connect local` shows the widget and `%rgpu widget` shows it again, yet one
  live copy is on the page; its counters move while a cell runs, and it shows the device's memory;
* an interrupt (I, I) during a long queue of matmuls: the kernel and the embedded server survive,
  the output says the queued work is skipped, and the next cell runs at once on the same server;
* the side panel: `%rgpu widget --side` moves the one widget out of the notebook, into view;
* a kernel restart: the old widget no longer says "connected" but that the kernel is gone.

Screenshots go to test-artifacts/ (and, with RGPU_SCREENSHOTS=1, the README's to docs/img/).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from test_browser import ARTIFACTS, CHROMIUM, start_jupyterlab

ROOT = Path(__file__).resolve().parent.parent

CELLS = [
    "%load_ext rgpu_jupyter\n%rgpu connect local\nimport time, torch, rgpu\n"
    "url0 = rgpu.current_session().url",
    "%rgpu widget",
    'x = torch.randn(128, 128, device="rgpu")\nt0 = time.time()\nwhile time.time() - t0 < 8:\n'
    '    x = (x @ x).tanh()\n    x.sum().item()\nbig = torch.ones(1 << 22, device="rgpu")\n'
    'print("worked")',
    # minutes of queued matmuls on any CPU here (one 1024-wide one takes 10-40 ms): the interrupt,
    # not the work's end, is what finishes this cell
    'y = torch.randn(2048, 2048, device="rgpu")\nfor _ in range(2000):\n    y = (y @ y).tanh()\n'
    "y.sum().item()",
    't = time.time()\nv = torch.ones(2, device="rgpu").sum().item()\n'
    'print("next", v, rgpu.current_session().url == url0, round(time.time() - t) < 10)',
    '%rgpu widget --side\nx = torch.randn(128, 128, device="rgpu")\nfor _ in range(300):\n'
    "    x = (x @ x).tanh()\n    x.sum().item()",
]

pytestmark = [
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason=f"{CHROMIUM} is not installed (apt-get install chromium)",
    ),
    pytest.mark.timeout(400),
]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """JupyterLab with the stories' notebook open in Chromium."""
    playwright = pytest.importorskip("playwright.sync_api")
    tmp = tmp_path_factory.mktemp("stories")
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(c) for c in CELLS],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}},
    )  # fmt: skip
    (tmp / "lab").mkdir()
    nbformat.write(nb, tmp / "lab" / "stories.ipynb")
    env = {k: v for k, v in os.environ.items() if k != "RGPU_SERVER"}
    env["RGPU_LOCAL_DEVICE"] = "cpu"
    ARTIFACTS.mkdir(exist_ok=True)
    with start_jupyterlab(tmp, env, "stories.ipynb") as url, playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update"],
        )  # fmt: skip
        pg = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            pg.goto(url)
            pg.wait_for_selector(".jp-Notebook .jp-Cell .cm-content", timeout=90_000)
            wait_idle(pg)
            yield pg
        finally:
            browser.close()


def wait_idle(page, timeout: float = 90_000) -> None:
    page.wait_for_function(
        "() => (document.querySelector('#jp-main-statusbar')?.innerText || '').includes('| Idle')",
        timeout=timeout,
    )


def prompt(page, i: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(i).locator(".jp-InputPrompt").inner_text()


def run_cell(page, i: int) -> None:
    """Ctrl+Enter in cell `i`; again if JupyterLab did not take it."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(i)
    before = prompt(page, i)
    for _ in range(3):
        cell.locator(".cm-content").click()
        page.keyboard.press("Control+Enter")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if prompt(page, i).strip() not in (before.strip(), "[ ]:", ""):
                return
            page.wait_for_timeout(100)
    raise AssertionError(f"JupyterLab never started running cell {i}")


def wait_done(page, i: int, timeout: float = 120) -> str:
    """Wait for cell `i` to finish; its output text."""
    deadline = time.monotonic() + timeout
    while "*" in prompt(page, i):
        assert time.monotonic() < deadline, f"cell {i} still running"
        page.wait_for_timeout(200)
    return output(page, i)


def output(page, i: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(i).locator(".jp-OutputArea").inner_text()


def counters(page) -> tuple[str, int, int]:
    live = page.locator(".rgpu-live")
    return (
        live.locator(".rgpu-what").first.inner_text(),
        int(live.locator(".rgpu-messages").first.inner_text()),
        int(live.locator(".rgpu-waits").first.inner_text()),
    )


def test_widget_story_one_live_copy_moving_counters_and_memory(page):
    run_cell(page, 0)
    out = wait_done(page, 0, timeout=180)
    assert "rgpu: connected to ws://127.0.0.1:" in out, out
    assert "run %rgpu connect URL to use a remote GPU" in out  # the notice in the magic's form
    page.wait_for_selector(".rgpu-live .rgpu-state", timeout=30_000)
    run_cell(page, 1)
    wait_done(page, 1)
    page.wait_for_selector(".rgpu-moved", timeout=30_000)
    assert page.locator(".rgpu-widget").count() == 1  # one live copy, in the newest place
    assert page.locator(".jp-Cell").nth(1).locator(".rgpu-widget").count() == 1
    assert "moved to a later cell" in output(page, 0)

    run_cell(page, 2)
    deadline = time.monotonic() + 60
    first = counters(page)
    while not first[0].startswith("running [") or first[2] == 0:
        assert time.monotonic() < deadline, first
        page.wait_for_timeout(100)
        first = counters(page)
    page.wait_for_timeout(2500)  # a probe (every 2 s) has brought the device's memory and RTT
    second = counters(page)
    assert second[0] == first[0] and second[1] > first[1] and second[2] > first[2], (first, second)
    live = page.locator(".rgpu-live").first
    assert re.fullmatch(
        r"\d+\.\d [KMGT]iB / \d+\.\d [KMGT]iB host RAM, this session .+ \(server process .+\)",
        live.locator(".rgpu-memory").inner_text(),
    )
    assert live.locator(".rgpu-util").inner_text().startswith("n/a on a CPU server")
    assert re.fullmatch(r"[\d.<]+ (µs|ms|s)", live.locator(".rgpu-rtt").inner_text())
    assert "waiting (" in live.locator(".rgpu-elapsed").inner_text()
    assert "rgpu-running" in page.locator(".rgpu-widget").get_attribute("class")
    # the running border shows: a real colour, not the transparent default
    colour = page.locator(".rgpu-widget").evaluate("e => getComputedStyle(e).borderLeftColor")
    assert colour not in ("rgba(0, 0, 0, 0)", "transparent"), colour
    shot = page.locator(".rgpu-widget")
    shot.screenshot(path=str(ARTIFACTS / "stories-widget-running.png"))
    if os.environ.get("RGPU_SCREENSHOTS"):
        (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
        shot.screenshot(path=str(ROOT / "docs" / "img" / "widget.png"))
    assert "worked" in wait_done(page, 2)
    page.wait_for_timeout(500)
    assert counters(page)[0].startswith("last cell [")


def test_interrupt_story_the_kernel_and_server_survive_and_queued_work_stops(page):
    run_cell(page, 3)
    page.wait_for_timeout(4000)  # the loop has queued its matmuls; the cell waits in .item()
    assert "*" in prompt(page, 3)
    page.keyboard.press("Escape")  # command mode, then I, I
    page.keyboard.press("i")
    page.keyboard.press("i")
    out = wait_done(page, 3, timeout=60)
    assert "KeyboardInterrupt" in out, out
    assert "the server skips the work of up to" in out, out
    t0 = time.monotonic()
    run_cell(page, 4)
    out = wait_done(page, 4, timeout=60)
    took = time.monotonic() - t0
    page.screenshot(path=str(ARTIFACTS / "stories-after-interrupt.png"))
    assert "next 2.0 True True" in out, out  # the same embedded server, answering promptly
    assert took < 30, took


def test_side_panel_story_the_widget_leaves_the_notebook_and_stays_in_view(page):
    run_cell(page, 5)
    out = wait_done(page, 5, timeout=120)
    assert "the live widget is in JupyterLab's side panel" in out, out
    page.wait_for_timeout(500)
    assert page.locator(".rgpu-widget").count() == 1
    assert page.locator(".jp-Notebook .rgpu-widget").count() == 0  # not in any cell
    assert page.locator(".rgpu-widget").first.is_visible()
    assert counters(page)[0] == "last cell [6]" and counters(page)[2] == 300
    page.locator(".jp-Notebook .jp-Cell").nth(0).scroll_into_view_if_needed()  # scrolled away:
    assert page.locator(".rgpu-widget").first.is_visible()  # the panel still shows it
    page.screenshot(path=str(ARTIFACTS / "stories-side-panel.png"))
    if os.environ.get("RGPU_SCREENSHOTS"):
        page.screenshot(path=str(ROOT / "docs" / "img" / "widget-side.png"))


def test_restart_story_the_old_widget_says_the_kernel_is_gone(page):
    live = page.locator(".rgpu-widget").first
    assert live.locator(".rgpu-alive").is_visible()
    page.locator(".jp-Notebook").click()
    page.keyboard.press("Escape")
    page.keyboard.press("0")  # 0, 0: restart the kernel (after a confirmation)
    page.keyboard.press("0")
    page.locator(".jp-Dialog-button.jp-mod-accept").click(timeout=30_000)
    page.wait_for_selector(".rgpu-widget .rgpu-gone", state="visible", timeout=60_000)
    assert not live.locator(".rgpu-alive").is_visible()
    assert live.locator(".rgpu-state-gone").inner_text() == "kernel gone: this view is stale"
    page.screenshot(path=str(ARTIFACTS / "stories-after-restart.png"))
