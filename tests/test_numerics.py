"""torch's numeric settings reach the server: float32 matmul precision (bf16 through oneDNN on a
CPU with AMX or AVX-512 BF16, TF32 on a GPU), deterministic algorithms and their filling of
uninitialised memory. The server is another process, so without SETTINGS it keeps torch's
defaults whatever the client set."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

import rgpu
import rgpu.numerics
from rgpu_protocol import Kind


@pytest.fixture
def restore_settings():
    """Put torch's defaults back here and on the server (the settings are process-wide)."""
    yield
    try:
        torch.set_float32_matmul_precision("highest")
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = True
        torch.backends.mkldnn.matmul.fp32_precision = "none"
        torch.rgpu.synchronize()
    except rgpu.RemoteError:
        pass
    finally:  # else every later connect in this process sends the settings: one more message
        rgpu.numerics.CHANGES.clear()


def _operands() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 300, generator=g), torch.randn(300, 64, generator=g)


def test_float32_matmul_precision_follows_the_client(dev, restore_settings):
    a, b = _operands()
    ra, rb = a.to(dev), b.to(dev)
    exact = a @ b
    assert torch.equal((ra @ rb).cpu(), exact)
    torch.set_float32_matmul_precision("medium")
    reduced = a @ b  # bf16 where this CPU has it (AMX / AVX-512 BF16), else exact again
    assert torch.equal((ra @ rb).cpu(), reduced)
    torch.set_float32_matmul_precision("highest")
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # the same, set on the backend
    assert torch.equal((ra @ rb).cpu(), a @ b)
    torch.backends.mkldnn.matmul.fp32_precision = "none"
    assert torch.equal((ra @ rb).cpu(), exact)


def test_deterministic_algorithms_fill_uninitialised_memory_on_the_server(dev, restore_settings):
    torch.use_deterministic_algorithms(True)
    x = torch.empty(5, device=dev)
    i = torch.empty(3, dtype=torch.long, device=dev)
    like = torch.empty_like(torch.zeros(2, 3, device=dev))
    grown = torch.zeros(2, device=dev).resize_(6)
    assert torch.empty(5).isnan().all()  # the CPU's behaviour, the reference
    assert x.cpu().isnan().all()
    assert torch.equal(i.cpu(), torch.empty(3, dtype=torch.long))
    assert like.cpu().isnan().all()
    assert torch.equal(grown.cpu()[:2], torch.zeros(2)) and grown.cpu()[2:].isnan().all()
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.use_deterministic_algorithms(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert rgpu.numerics.CHANGES["deterministic"] == [True, True]
    assert rgpu.numerics.CHANGES["fill_uninitialized_memory"] is False


def test_each_change_is_one_message_in_order_with_the_ops(counted, restore_settings):
    a, b = _operands()
    exact = a @ b
    torch.set_float32_matmul_precision("medium")
    reduced = a @ b
    torch.set_float32_matmul_precision("highest")
    ra, rb = a.to("rgpu"), b.to("rgpu")
    torch.rgpu.synchronize()
    before = counted()["messages"]
    first = ra @ rb  # queued before the change, it runs with the old precision
    torch.set_float32_matmul_precision("medium")
    second = ra @ rb
    assert counted()["messages"] - before == 3  # two RUNs and one SETTINGS, no wait
    assert torch.equal(first.cpu(), exact)
    assert torch.equal(second.cpu(), reduced)


def test_settings_made_before_connecting_reach_the_new_session(server, restore_settings):
    rgpu.disconnect()
    torch.set_float32_matmul_precision("medium")
    torch.use_deterministic_algorithms(True)
    rgpu.connect(server.url)
    a, b = _operands()
    assert torch.equal((a.to("rgpu") @ b.to("rgpu")).cpu(), a @ b)
    assert torch.empty(4, device="rgpu").cpu().isnan().all()


_OTHER_CLIENT = """
import sys, torch, rgpu
rgpu.connect(sys.argv[1])
g = torch.Generator().manual_seed(0)
a, b = torch.randn(64, 300, generator=g), torch.randn(300, 64, generator=g)
print(torch.equal((a.to("rgpu") @ b.to("rgpu")).cpu(), a @ b))
"""


def test_another_session_on_the_server_keeps_its_own_settings(dev, server, restore_settings):
    a, b = _operands()
    ra, rb = a.to(dev), b.to(dev)
    torch.set_float32_matmul_precision("medium")
    reduced = a @ b
    assert torch.equal((ra @ rb).cpu(), reduced)  # the server runs with "medium" now
    other = subprocess.run([sys.executable, "-c", _OTHER_CLIENT, server.url],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert other.returncode == 0, other.stderr
    assert other.stdout.split() == ["True"]  # it ran with torch's default, "highest"
    assert torch.equal((ra @ rb).cpu(), reduced)  # and this one has "medium" back


def test_a_setting_the_server_does_not_know_is_an_error_at_the_next_wait(session, dev):
    session.post((Kind.SETTINGS, [["backends.cuda.matmul.allow_magic", True]]))
    with pytest.raises(rgpu.RemoteError, match="unknown numeric setting.*allow_magic"):
        torch.rgpu.synchronize()
    assert (torch.ones(2, device=dev) + 1).cpu().tolist() == [2.0, 2.0]  # the session goes on
    session.post((Kind.SETTINGS, [[["a", "list"], True], "not a pair"]))  # not even a name
    with pytest.raises(rgpu.RemoteError, match=r"unknown numeric setting \[\['a', 'list'\]"):
        torch.rgpu.synchronize()
    assert (torch.ones(2, device=dev) * 3).cpu().tolist() == [3.0, 3.0]


_REOPEN = """
import sys, torch, rgpu
rgpu.connect(sys.argv[1], session=sys.argv[2])
g = torch.Generator().manual_seed(0)
a, b = torch.randn(64, 300, generator=g), torch.randn(300, 64, generator=g)
print(torch.equal((a.to("rgpu") @ b.to("rgpu")).cpu(), a @ b))
rgpu.disconnect(drop=True)
"""


def test_a_named_session_reopened_by_a_new_client_starts_from_the_defaults(
    server, restore_settings
):
    rgpu.connect(server.url, session="numerics-reopened")
    torch.set_float32_matmul_precision("medium")
    a, b = _operands()
    assert torch.equal((a.to("rgpu") @ b.to("rgpu")).cpu(), a @ b)
    rgpu.disconnect()  # the named session waits on the server, "medium" with it
    torch.set_float32_matmul_precision("highest")
    rgpu.numerics.CHANGES.clear()  # the new client below has set nothing
    other = subprocess.run([sys.executable, "-c", _REOPEN, server.url, "numerics-reopened"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert other.returncode == 0, other.stderr
    assert other.stdout.split() == ["True"]
    rgpu.connect(server.url)


def test_the_flags_context_managers_are_followed_in_and_out(dev, restore_settings):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, 32, 32, generator=g), torch.randn(32, 16, 3, 3, generator=g)
    rx, rw = x.to(dev), w.to(dev)
    onednn = torch.nn.functional.conv2d(x, w)
    with torch.backends.mkldnn.flags(enabled=False):  # torch warns about oneDNN TF32: harmless
        direct = torch.nn.functional.conv2d(x, w)  # PyTorch's own kernel: other rounding
        inside = torch.nn.functional.conv2d(rx, rw)
    after = torch.nn.functional.conv2d(rx, rw)
    assert not torch.equal(direct, onednn)
    assert torch.equal(inside.cpu(), direct)
    assert torch.equal(after.cpu(), onednn)
    with torch.backends.cudnn.flags(enabled=False, deterministic=True):
        assert rgpu.numerics.CHANGES["backends.cudnn.deterministic"] is True
        assert rgpu.numerics.CHANGES["backends.cudnn.enabled"] is False
    assert "backends.cudnn.deterministic" not in rgpu.numerics.CHANGES  # torch's default again
    assert "backends.cudnn.enabled" not in rgpu.numerics.CHANGES


_SET_BEFORE_IMPORT = """
import sys, torch
torch.set_float32_matmul_precision("medium")
torch.use_deterministic_algorithms(True)
import rgpu
rgpu.connect(sys.argv[1])
g = torch.Generator().manual_seed(0)
a, b = torch.randn(64, 300, generator=g), torch.randn(300, 64, generator=g)
print(torch.equal((a.to("rgpu") @ b.to("rgpu")).cpu(), a @ b))
print(bool(torch.empty(3, device="rgpu").isnan().all()))
"""


def test_settings_made_before_rgpu_was_imported_are_followed(server):
    done = subprocess.run([sys.executable, "-c", _SET_BEFORE_IMPORT, server.url],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


def test_setting_a_flag_to_the_value_it_has_sends_nothing(dev, restore_settings):
    gc.collect()
    torch.rgpu.synchronize()  # the FREE of earlier tests' tensors goes now
    before = rgpu.stats()["messages"]
    torch.use_deterministic_algorithms(False)  # what Dynamo does after every frame it compiles
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(3))
    torch.use_deterministic_algorithms(True)
    torch.use_deterministic_algorithms(True)
    torch.use_deterministic_algorithms(False)
    assert rgpu.stats()["messages"] - before == 2  # one SETTINGS each way
    assert rgpu.numerics.CHANGES == {}  # back at torch's default: a new session needs nothing


_BUSY_CLIENT = """
import sys, time, torch, rgpu
rgpu.connect(sys.argv[1])
deterministic = sys.argv[2] == "deterministic"
torch.use_deterministic_algorithms(deterministic)
x = torch.randn(128, 128, device="rgpu") / 10
index, values = torch.tensor([0, 0], device="rgpu"), torch.tensor([1.0, 2.0], device="rgpu")
torch.rgpu.synchronize()  # the settings in force (deterministic mode's first use imports inductor)
print("ready", flush=True)
sys.stdin.readline()
runs = nan_filled = refused = 0
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    y = x
    for _ in range(30):  # a frame long enough for the other session's to start inside it
        y = torch.tanh(y @ x)
    empty = torch.empty(4096, device="rgpu")
    try:  # put_ without accumulate has no deterministic implementation
        torch.zeros(5, device="rgpu").put_(index, values).cpu()
    except rgpu.RemoteError as e:
        assert "deterministic" in str(e), e
        refused += 1
    nan_filled += bool(empty.isnan().all().item())
    runs += 1
print(runs, nan_filled, refused)
"""


def test_sessions_running_at_once_keep_their_own_settings(server):
    """Found this way: while one session's frame ran, another's started and put its settings in
    force for both (torch's flags are per process): a deterministic session's put_ ran and its
    empty tensors came unfilled, and the other session's put_ failed for want of a deterministic
    implementation, about half the time each."""
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", _BUSY_CLIENT, server.url, mode, "3"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for mode in ("deterministic", "default")
    ]
    try:
        for c in clients:
            assert c.stdout.readline().strip() == "ready"
        for c in clients:  # both sessions run their loops at the same time
            c.stdin.write("\n")
            c.stdin.flush()
        results = [c.communicate(timeout=120)[0].split() for c in clients]
    finally:
        for c in clients:
            c.kill()
    (runs, filled, refused), (other_runs, _, other_refused) = (map(int, r) for r in results)
    assert runs > 5 and other_runs > 5
    assert filled == refused == runs  # every frame of the deterministic session under its mode
    assert other_refused == 0  # and none of the other's
