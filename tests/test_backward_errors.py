"""An exception during backward on rgpu tensors comes out of `.backward()` / `autograd.grad()` as
on the CPU; it used to abort the whole process ("terminate called without an active
exception"), killing a notebook's kernel: PyTorch calls a Python backend's device guard while
unwinding the engine with the Python error still pending.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import rgpu  # noqa: F401


def _boom(*args):
    raise ValueError("boom from a hook")


def _hooked(kind: str, device: str):
    p = torch.nn.Parameter(torch.ones(3, device=device))
    if kind == "leaf":
        p.register_hook(_boom)
    elif kind == "post_accumulate":
        p.register_post_accumulate_grad_hook(_boom)
    elif kind == "wrong_return":
        p.register_hook(lambda g: (g, g))
    y = p * 2
    if kind == "non_leaf":
        y.register_hook(_boom)
    return p, y.pow(2).sum()


def _raised(fn) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn()
    return info.type, str(info.value)


@pytest.mark.parametrize("kind", ["leaf", "non_leaf", "post_accumulate", "wrong_return"])
def test_a_hook_that_raises_raises_from_backward_as_on_the_cpu(session, kind):
    expected = _raised(lambda: _hooked(kind, "cpu")[1].backward())
    assert _raised(lambda: _hooked(kind, "rgpu")[1].backward()) == expected
    if kind != "post_accumulate":  # grad() accumulates nothing: that hook does not run
        p, loss = _hooked(kind, "rgpu")
        assert _raised(lambda: torch.autograd.grad(loss, p)) == expected
    # the session goes on: the next backward is exact
    q = torch.nn.Parameter(torch.arange(3.0, device="rgpu"))
    (q * q).sum().backward()
    assert torch.equal(q.grad.cpu(), torch.arange(3.0) * 2)


def test_module_backward_hooks_that_raise_raise_from_backward(session):
    for device in ("cpu", "rgpu"):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2).to(device)
        x = torch.ones(4, 3, device=device, requires_grad=True)
        h = m.register_full_backward_hook(lambda mod, gi, go: _boom())
        with pytest.raises(ValueError, match="boom from a hook"):
            m(x).sum().backward()
        h.remove()
        h = m.register_full_backward_pre_hook(lambda mod, go: _boom())
        with pytest.raises(ValueError, match="boom from a hook"):
            torch.autograd.grad(m(x).sum(), x)
        h.remove()
        m.zero_grad()
        m(x).sum().backward()
        assert torch.equal(m.weight.grad.cpu(), torch.full((2, 3), 4.0))


def test_an_error_in_a_builtin_backward_formula_raises_from_backward(session):
    # max_unpool2d's backward views its non-contiguous indices: PyTorch's own error, on both
    inp = torch.tensor([[[[8.5, 8.5, 4.3, -0.7], [8.5, 8.6, 4.3, 1.9]]]])
    idx = torch.tensor([[[[7, 7, 10, 11], [7, 14, 10, 17]]]])

    def unpool(device):
        def strided(t):
            return t.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0).to(device)

        x = strided(inp).requires_grad_()
        out = F.max_unpool2d(x, strided(idx), 3, stride=2, padding=1, output_size=(3, 6))
        out.sum().backward()

    expected = _raised(lambda: unpool("cpu"))
    assert _raised(lambda: unpool("rgpu")) == expected


def test_a_sparse_gradient_is_a_clear_error_not_an_abort(session):
    w = torch.randn(10, 4, device="rgpu", requires_grad=True)
    with pytest.raises(NotImplementedError, match="dense .strided. tensors only"):
        F.embedding(torch.tensor([1, 2, 4], device="rgpu"), w, sparse=True).sum().backward()
    F.embedding(torch.tensor([1, 2, 4], device="rgpu"), w).sum().backward()
    expected = torch.zeros(10, 4)
    expected[[1, 2, 4]] = 1
    assert torch.equal(w.grad.cpu(), expected)


def _script_output(code: str, url: str) -> list[str]:
    """Lines a fresh Python process printed (autograd's threads and signals are per process)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), url], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")


BACKWARD_BEFORE_IMPORT = """
    import sys, threading, torch
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()  # autograd sizes its device threads here, before rgpu exists
    import rgpu
    rgpu.connect(sys.argv[1])
    w = torch.arange(3.0, device="rgpu", requires_grad=True)
    (w * w).sum().backward()
    print(w.grad.cpu().tolist())
    def in_a_thread():
        v = torch.ones(2, device="rgpu", requires_grad=True)
        print(torch.autograd.grad((v * 3).sum(), v)[0].cpu().tolist())
    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
"""


def test_backward_works_after_a_cpu_backward_that_ran_before_import(server):
    """Autograd gives each device type its worker threads at the process's first backward; one
    before `import rgpu` (a CPU model trained earlier in the notebook) left rgpu without any, and
    every rgpu backward failed an INTERNAL ASSERT in engine.cpp. rgpu runs backward in the
    calling thread, which needs none."""
    assert _script_output(BACKWARD_BEFORE_IMPORT, server.url)[:2] == [
        "[0.0, 2.0, 4.0]",
        "[3.0, 3.0]",
    ]


CTRL_C_DURING_BACKWARD = """
    import os, signal, sys, threading, time, torch, rgpu
    rgpu.connect(sys.argv[1])
    w = torch.ones(4, device="rgpu", requires_grad=True)
    y = w
    for _ in range(20000):  # a backward of ~40,000 ops (a second or so), each run in Python
        y = y * 1.0 + 0.0
    loss = y.sum()
    def ctrl_c():
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)
    # as backward starts, Ctrl-C from another thread: it lands in an op the engine runs
    loss.register_hook(lambda g: threading.Thread(target=ctrl_c).start())
    try:
        loss.backward()
        print("no interrupt")
    except KeyboardInterrupt:
        print("interrupted after backward:", w.grad.cpu().tolist())
    print("still working:", (w * 2).sum().item())
"""


def test_ctrl_c_during_backward_interrupts_after_it_and_keeps_the_process(server):
    """Backward runs in the calling thread, which takes the notebook's Ctrl-C: raised inside an
    op the engine runs, it aborted the process (the kernel died). The interrupt now comes when
    the engine returns, as it did from autograd's own threads, with the gradients complete."""
    assert _script_output(CTRL_C_DURING_BACKWARD, server.url)[:2] == [
        "interrupted after backward: [1.0, 1.0, 1.0, 1.0]",
        "still working: 8.0",
    ]
