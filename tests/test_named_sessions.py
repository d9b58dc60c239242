"""Named sessions: GPU state that outlives the process, with real processes killed with SIGKILL,
a real server restarted, and real tokens kept apart.

Every resumed run is compared, loss for loss, with an uninterrupted run on the same server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from rgpu_test_servers import TOKEN_FOR_TESTS

import rgpu

TRAIN = """
import json, os, signal, sys, torch, rgpu
def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
gen = torch.Generator().manual_seed(1)
data = [(torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(12)]
def train(model, opt, batches):
    out = []
    for x, y in batches:
        opt.zero_grad()
        x = x.to("rgpu")
        loss = torch.nn.functional.mse_loss(torch.nn.functional.dropout(model(x), 0.1), y.to("rgpu"))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out
"""
FIRST = (
    TRAIN
    + """
rgpu.connect(sys.argv[1], session="exp")
model = make().to("rgpu")
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = train(model, opt, data[:6])
rgpu.keep("model", model, durable=len(sys.argv) > 2)
rgpu.keep("opt", opt, durable=len(sys.argv) > 2)
print(json.dumps(losses), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
)
SECOND = (
    TRAIN
    + """
model = make()  # its seeding happens before the session is re-opened, which keeps its generator
session = rgpu.connect(sys.argv[1], session="exp")
assert session.kept_names == ("model", "opt"), session.kept_names
before = rgpu.stats()
model.load_state_dict(rgpu.kept("model"), assign=True)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
opt.load_state_dict(rgpu.kept("opt"))
after = rgpu.stats()
moved = after["bytes_in"] + after["bytes_out"] - before["bytes_in"] - before["bytes_out"]
print(json.dumps({"losses": train(model, opt, data[6:]), "moved": moved}), flush=True)
rgpu.disconnect(drop=True)
"""
)
WHOLE = (
    TRAIN
    + """
rgpu.connect(sys.argv[1])
model = make().to("rgpu")
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
print(json.dumps(train(model, opt, data)), flush=True)
"""
)


def _run(code: str, *args: str, token: str = TOKEN_FOR_TESTS) -> subprocess.CompletedProcess:
    env = {**os.environ, "RGPU_TOKEN": token}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=180, env=env)  # fmt: skip


def _first_line(done: subprocess.CompletedProcess):
    assert done.stdout.strip(), done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[0])


@pytest.fixture
def own_server(start_server):
    return start_server


def test_a_killed_client_is_followed_by_one_that_continues_bit_for_bit(own_server):
    srv = own_server()
    first = _run(FIRST, srv.url)
    assert first.returncode == -9
    second = _first_line(_run(SECOND, srv.url))
    whole = _first_line(_run(WHOLE, srv.url))
    assert _first_line(first) + second["losses"] == whole  # RNG state (dropout) included
    assert second["moved"] < 4096


def test_durable_kept_objects_survive_a_server_restart(own_server, tmp_path):
    state = tmp_path / "state"
    srv = own_server("--state-dir", str(state))
    first = _run(FIRST, srv.url, "durable")
    assert first.returncode == -9
    srv.stop()
    srv = own_server("--state-dir", str(state))  # a new server process, the same state dir
    assert "restored 1 named session(s)" in srv.wait_log("restored")
    second = _first_line(_run(SECOND, srv.url))
    whole = _first_line(_run(WHOLE, srv.url))
    assert _first_line(first) + second["losses"] == whole
    assert not list((state).rglob("tensors.pt"))  # drop=True removed its files


def test_attach_moves_no_tensor_bytes(own_server):
    srv = own_server()
    rgpu.connect(srv.url, session="big")
    weights = {f"w{i}": torch.randn(64, 1024 * 64, device="rgpu") for i in range(6)}  # 100 MB
    rgpu.keep("weights", weights)
    expected = {k: v[0, :8].cpu() for k, v in weights.items()}
    rgpu.disconnect()
    rgpu.connect(srv.url, session="big")
    before = rgpu.stats()
    back = rgpu.kept("weights")
    after = rgpu.stats()
    assert (
        after["bytes_in"] + after["bytes_out"] - before["bytes_in"] - before["bytes_out"] < 64 << 10
    )
    assert all(torch.equal(back[k][0, :8].cpu(), v) for k, v in expected.items())


def test_a_name_held_by_a_live_client_is_refused_or_taken_over(own_server):
    srv = own_server()
    holder = _holder(srv.url)
    try:
        with pytest.raises(rgpu.SessionInUse, match="in use by another client.*takeover=True"):
            rgpu.connect(srv.url, session="held")
        session = rgpu.connect(srv.url, session="held", takeover=True)
        assert session.kept_names == ("x",)
        assert torch.equal(rgpu.kept("x").cpu(), torch.arange(4.0))
        assert holder.stdout.readline().strip() == "lost"  # the old client got SessionLost
    finally:
        holder.kill()
        holder.wait()


def _holder(url: str) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import sys, time, torch, rgpu
        rgpu.connect("{url}", session="held")
        rgpu.keep("x", torch.arange(4.0, device="rgpu"))
        print("ready", flush=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                torch.rgpu.synchronize()
            except rgpu.SessionLost:
                print("lost", flush=True)
                break
            time.sleep(0.05)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "RGPU_TOKEN": TOKEN_FOR_TESTS})  # fmt: skip
    assert p.stdout.readline().strip() == "ready"
    return p


def test_another_token_cannot_list_or_open_a_session(own_server):
    other = "another-users-token-" + "x" * 20
    # --token=VALUE: a random token may start with "-", which argparse takes for an option
    srv = own_server(f"--token={TOKEN_FOR_TESTS}", f"--token={other}")
    rgpu.connect(srv.url, session="mine")
    rgpu.keep("t", torch.ones(3, device="rgpu"))
    rgpu.disconnect()
    rgpu.connect(srv.url, token=other, session="mine")  # the same name: another user's session
    assert rgpu.session_info()  # a fresh one
    assert rgpu.kept() == []
    names = [e.name for e in rgpu.sessions()]
    assert names == ["mine"] and rgpu.sessions()[0].current
    with pytest.raises(rgpu.keeping.KeepError, match="no session named 'other'"):
        rgpu.drop_session("other")
    rgpu.disconnect(drop=True)
    rgpu.connect(srv.url, session="mine")
    assert torch.equal(rgpu.kept("t").cpu(), torch.ones(3))


def test_a_detached_session_is_freed_after_its_ttl(own_server):
    srv = own_server("--detached-ttl", "1", "--session-grace", "1")
    rgpu.connect(srv.url)
    baseline = rgpu.session_info()["server"]["tensors"]
    rgpu.connect(srv.url, session="short")
    rgpu.keep("t", torch.ones(1000, device="rgpu"))
    rgpu.connect(srv.url)  # leaves "short" detached
    deadline = time.time() + 10
    while rgpu.session_info()["server"]["tensors"] != baseline and time.time() < deadline:
        time.sleep(0.2)
    assert rgpu.session_info()["server"]["tensors"] == baseline
    assert "('short') expired after 1 s" in srv.log()
    with pytest.raises(rgpu.keeping.KeepError, match="nothing is kept under 't'"):
        rgpu.connect(srv.url, session="short")
        rgpu.kept("t")


def test_max_detached_mb_and_the_quota_are_clean_errors(own_server):
    srv = own_server("--max-detached-mb", "8", "--session-quota-mb", "24")
    rgpu.connect(srv.url, session="a")
    small = torch.ones(1 << 20, device="rgpu")  # 4 MiB
    rgpu.keep("small", small)
    big = torch.ones(3 << 20, device="rgpu")  # 12 MiB more: past what may stay detached
    with pytest.raises(rgpu.keeping.KeepError, match="past this server's --max-detached-mb"):
        rgpu.keep("big", big)
    assert rgpu.kept() == ["small"]
    with pytest.raises(
        rgpu.RemoteError, match="OutOfMemoryError.*quota on this server is 25165824"
    ):
        torch.ones(4 << 20, device="rgpu").sum().item()  # 16 MiB more: past the session quota
    assert (small.sum() + 1).item() == float((1 << 20) + 1)  # the session goes on


def test_keep_needs_a_named_session_and_a_state_dir_for_durable(own_server):
    srv = own_server()
    rgpu.connect(srv.url)
    with pytest.raises(rgpu.keeping.KeepError, match="needs a named session"):
        rgpu.keep("x", torch.ones(2, device="rgpu"))
    rgpu.connect(srv.url, session="n")
    with pytest.raises(rgpu.keeping.KeepError, match="--state-dir"):
        rgpu.keep("x", torch.ones(2, device="rgpu"), durable=True)
    with pytest.raises(TypeError, match="a Thread is none of them"):
        import threading

        rgpu.keep("x", {"t": threading.Thread()})
    with pytest.raises(rgpu.ConnectError, match="not a session name"):
        rgpu.connect(srv.url, session="no/slashes")
    assert (torch.ones(2, device="rgpu") * 2).sum().item() == 4.0


def _execute(kc, code: str) -> str:
    """Run code in a real kernel; its stdout (raises with the traceback on an error)."""
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif kind == "error":
            raise AssertionError("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


def test_a_restarted_jupyter_kernel_continues_where_it_stopped(own_server):
    jupyter_client = pytest.importorskip("jupyter_client")
    srv = own_server()
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env={**os.environ, "RGPU_TOKEN": TOKEN_FOR_TESTS})
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        setup = TRAIN + "import json\n"
        _execute(
            kc,
            setup + f'rgpu.connect("{srv.url}", session="nb")\n'
            "model = make().to('rgpu')\nopt = torch.optim.Adam(model.parameters(), lr=1e-2)",
        )
        first = json.loads(_execute(kc, "losses = train(model, opt, data[:6])\n"
                                        "rgpu.keep('model', model); rgpu.keep('opt', opt)\n"
                                        "print(json.dumps(losses))"))  # fmt: skip
        km.restart_kernel(now=False)  # the kernel exits as a restart makes it, then starts again
        kc.wait_for_ready(timeout=120)
        _execute(kc, setup + "model = make()\n" + f'rgpu.connect("{srv.url}", session="nb")\n'
                 "model.load_state_dict(rgpu.kept('model'), assign=True)\n"
                 "opt = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
                 "opt.load_state_dict(rgpu.kept('opt'))")  # fmt: skip
        second = json.loads(_execute(kc, "print(json.dumps(train(model, opt, data[6:])))"))
        _execute(kc, "rgpu.disconnect(drop=True)")
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
    assert first + second == _first_line(_run(WHOLE, srv.url))


def test_drop_session_ends_another_clients_session(own_server):
    srv = own_server()
    holder = _holder(srv.url)
    try:
        rgpu.connect(srv.url)
        assert [e.name for e in rgpu.sessions() if not e.current] == ["held"]
        rgpu.drop_session("held")
        assert holder.stdout.readline().strip() == "lost"
        assert [e.name for e in rgpu.sessions() if not e.current] == []
        assert "('held') dropped by rgpu.drop_session" in srv.log()
    finally:
        holder.kill()
        holder.wait()


KEEP_ON_DEVICE_1 = """
import json, sys, torch, rgpu
rgpu.connect(sys.argv[1], session="dev1")
x = torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024).to("rgpu:1")  # 1 MiB
m = torch.nn.Linear(4, 2).to("rgpu:1")
rgpu.keep("x", x, durable=len(sys.argv) > 2)
rgpu.keep("m", m, durable=len(sys.argv) > 2)
print(json.dumps(m.weight.tolist()), flush=True)
rgpu.disconnect()
"""


def _attach_on_device_1(url: str, weight: list, m_device: int = 1) -> None:
    """Kept tensors come back on the device they were kept from, counted there."""
    rgpu.connect(url, session="dev1")
    x, m = rgpu.kept("x"), rgpu.kept("m")
    assert x.device == torch.device("rgpu", 1)
    assert {t.device for t in m.values()} == {torch.device("rgpu", m_device)}
    assert torch.equal(x.cpu(), torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024))
    assert m["weight"].cpu().tolist() == weight
    assert x.to("rgpu:1") is x
    torch.rgpu.synchronize()
    m_bytes = sum(t.untyped_storage().nbytes() for t in m.values())
    on_1 = (1 << 20) + (m_bytes if m_device == 1 else 0)
    assert torch.rgpu.memory_allocated(1) == on_1
    assert torch.rgpu.memory_allocated(0) == (m_bytes if m_device == 0 else 0)
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(1024, device="rgpu:0")
    rgpu.disconnect(drop=True)


def test_tensors_kept_from_a_device_come_back_on_it(own_server):
    srv = own_server("--virtual-devices", "2")
    first = _run(KEEP_ON_DEVICE_1, srv.url)
    _attach_on_device_1(srv.url, _first_line(first))


def test_durable_tensors_come_back_on_their_device_after_a_restart(own_server, tmp_path):
    state = tmp_path / "state"
    srv = own_server("--virtual-devices", "2", "--state-dir", str(state))
    weight = _first_line(_run(KEEP_ON_DEVICE_1, srv.url, "durable"))
    srv.stop()
    srv = own_server("--virtual-devices", "2", "--state-dir", str(state))
    assert "restored 1 named session(s)" in srv.wait_log("restored")
    # a store written before devices were recorded: its tensors are restored onto device 0
    (m_devices,) = [p for p in state.rglob("devices.msgpack") if p.parent.name == "m"]
    m_devices.unlink()
    _attach_on_device_1(srv.url, weight, m_device=0)
