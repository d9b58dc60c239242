"""Ctrl-C stops work, not just the wait: queued ops the server has not started are skipped, the
embedded server survives the kernel's interrupt, and an explicit disconnect starts nothing."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import rgpu


@pytest.fixture
def sigint():
    """The SIGINT handler these tests rely on (a run from nohup or a background job ignores it)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_an_interrupt_cancels_the_queued_work_the_server_has_not_started(dev, sigint):
    x = torch.randn(384, 384, device=dev)
    torch.rgpu.synchronize()
    before = rgpu.session_info()["ops_run"]
    ys = [x @ x for _ in range(3000)]  # seconds of work on this machine
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt) as interrupt:
        ys[-1].sum().item()
    timer.join()
    assert "the server skips the work of up to" in "\n".join(interrupt.value.__notes__)
    # in IPython: the test's own line, not rgpu's or torch's, then the note
    shown = interrupt.value._render_traceback_()
    assert "ys[-1].sum().item()" in "\n".join(shown) and "dispatch" not in "\n".join(shown)
    assert shown[-1].startswith("rgpu: the server skips the work")
    assert (x[0, 0] * 0 + 1).item() == 1.0  # the session goes on, and waits for nothing queued
    ran = rgpu.session_info()["ops_run"] - before
    assert ran < 3000  # most of the queue never ran
    with pytest.raises(rgpu.RemoteError, match="cancelled: an interrupt"):
        ys[-1].cpu()
    assert torch.equal((x + 1).cpu(), x.cpu() + 1)  # what was not queued then runs as usual


def test_the_embedded_server_survives_an_interrupt_of_the_process_group(server):
    """Jupyter's "interrupt kernel" signals the kernel's process group."""
    code = textwrap.dedent("""
        import os, signal, time, torch, rgpu
        os.setpgrp()  # a group of its own, as a kernel has
        signal.signal(signal.SIGINT, lambda *a: print("interrupted", flush=True))
        rgpu.connect("local")
        x = torch.arange(4.0, device="rgpu")
        os.killpg(os.getpgrp(), signal.SIGINT)
        time.sleep(0.5)
        print(int((x * 2).sum().item()), rgpu.current_session().state, flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "RGPU_SERVER"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert done.stdout.split() == ["interrupted", "12", "connected"], done.stderr[-2000:]


def test_after_disconnect_the_device_starts_no_server(server):
    rgpu.connect(server.url)
    rgpu.disconnect()
    with pytest.raises(rgpu.RgpuError, match="rgpu is disconnected.*rgpu.connect()"):
        torch.ones(2, device="rgpu")
    torch.rgpu.empty_cache()  # what libraries call to tidy up: nothing to release, no server
    if torch.accelerator.current_accelerator().type == "rgpu":
        torch.accelerator.empty_cache()
    assert rgpu.current_session() is None
    rgpu.connect(server.url)
    assert torch.ones(2, device="rgpu").sum().item() == 2.0


def test_the_servers_first_info_imports_no_compiler():
    code = "import sys, rgpu_server.graphs as g; g.CACHE.counters(); print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
