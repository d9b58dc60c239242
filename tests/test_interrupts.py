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


def test_ctrl_c_leaves_tensors_written_in_place_as_they_were_not_poisoned(dev, session):
    """The server stops where it was, as a local interrupt stops the program at a line: what ran
    ran, an in-place write it had not started leaves its target as it was. It poisoned the target
    (a model's weights, after Ctrl-C during training, all raised 'cancelled')."""
    x = torch.randn(2000, 2000, device=dev)
    p = torch.arange(6.0, device=dev)
    q = torch.arange(6.0, device=dev)
    out = torch.zeros(2000, 2000, device=dev)
    torch.rgpu.synchronize()
    a = x
    for _ in range(40):  # several seconds of server work
        a = (a @ a).tanh()
    p.add_(a[0, :6])  # not started when the interrupt comes
    q.unsqueeze_(0)  # the client's shape changed already: this one no longer agrees
    torch.matmul(a, a, out=out)  # out= may resize: poisoned too
    interrupt = DuringNextWait(session, ctrl_c, after=0.3)
    with pytest.raises(KeyboardInterrupt):
        a.sum().item()
    interrupt.join()
    assert torch.equal(p.cpu(), torch.arange(6.0))
    for poisoned in (q, out):
        with pytest.raises(rgpu.RemoteError, match="cancelled: an interrupt"):
            poisoned.sum().item()
    with pytest.raises(rgpu.RemoteError, match="cancelled: an interrupt"):
        a.sum().item()  # a new result the server never made still says so


def test_training_goes_on_after_ctrl_c_interrupts_it(dev, session):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1))
    model.to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 512, device=dev), torch.randn(256, 1, device=dev)

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    step().item()  # the optimizer's state exists before the interrupt
    interrupt = DuringNextWait(session, ctrl_c, after=0.3)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(400):
            loss = step()
        loss.item()
    interrupt.join()
    # every weight and optimizer state is a value some prefix of the queued work left
    for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]:
        assert torch.isfinite(t.cpu()).all()
    before = step().item()
    for _ in range(5):
        after = step().item()
    assert after < before
