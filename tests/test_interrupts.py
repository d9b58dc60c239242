"""Ctrl-C ("interrupt kernel") during a wait or a long upload: control returns within a second,
and the session stays consistent and usable."""

from __future__ import annotations

import gc
import signal
import threading
import time

import pytest
import torch
from fault_proxy import FaultProxy
from waits import DuringNextWait

import rgpu


@pytest.fixture(autouse=True)
def ctrl_c_raises_keyboard_interrupt():
    """These tests need SIGINT to raise KeyboardInterrupt, Python's default; a test run started
    from a background job or nohup inherits SIGINT ignored. The old handler comes back after."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def ctrl_c() -> None:
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def test_ctrl_c_during_a_wait_returns_promptly_and_cancels_the_queued_work(dev, session):
    a = torch.randn(2000, 2000, device=dev)
    for _ in range(40):  # several seconds of server work
        a = (a @ a).tanh()
    interrupt = DuringNextWait(session, ctrl_c, after=0.3)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        a.sum().item()
    interrupt.join()
    assert time.perf_counter() - t0 < 1.3  # 0.3 s until the interrupt, then under a second
    # the work the server had not started is dropped: its result says so, and promptly
    t0 = time.perf_counter()
    with pytest.raises(rgpu.RemoteError, match="cancelled: an interrupt"):
        a.sum().item()
    assert time.perf_counter() - t0 < 5  # not the ~40 products the loop queued
    assert torch.ones(3, device=dev).sum().item() == 3.0


def test_ctrl_c_during_a_data_dependent_op_frees_its_outputs(dev, session):
    gc.collect()
    torch.rgpu.synchronize()
    base = session.info()["tensors"]
    a = torch.randn(2000, 2000, device=dev)
    for _ in range(30):
        a = (a @ a).tanh()
    interrupt = DuringNextWait(session, ctrl_c, after=0.3)
    with pytest.raises(KeyboardInterrupt):
        torch.nonzero(a > 0)  # waits for the server; its outputs arrive after we gave up
    interrupt.join()
    del a
    gc.collect()
    deadline = time.time() + 60
    while session.info()["tensors"] > base and time.time() < deadline:
        time.sleep(0.2)
    assert session.info()["tensors"] <= base  # the abandoned outputs were freed


def test_ctrl_c_during_a_long_upload_cancels_it_cleanly(server):
    proxy = FaultProxy(int(server.url.rsplit(":", 1)[1]), bandwidth_bps=40e6)  # a 40 MB/s link
    try:
        rgpu.connect(proxy.url)
        big = torch.randn(50_000_000)  # 200 MB: five seconds at this speed
        dst = torch.empty(50_000_000, device="rgpu")
        # 1 s into an upload of five: the link's bandwidth cap keeps it in flight
        interrupt = threading.Timer(1.0, ctrl_c)
        interrupt.start()
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            dst.copy_(big)
        interrupt.join()
        assert time.perf_counter() - t0 < 2.0
        # the destination holds no data: using it says so, instead of showing half an upload
        with pytest.raises(rgpu.RemoteError, match="upload was interrupted"):
            dst.sum().item()
        # and the session carries on, uploads included
        small = torch.randn(100_000)
        assert torch.equal(small.to("rgpu").cpu(), small)
        assert torch.ones(2, device="rgpu").sum().item() == 2.0
    finally:
        rgpu.disconnect()
        proxy.close()
