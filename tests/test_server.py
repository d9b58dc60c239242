"""The server as a process: flags, logs, isolation of sessions, hostile clients, the embedded server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

import rgpu
import rgpu_protocol as p

AUTH = {"Authorization": f"Bearer {os.environ['RGPU_TOKEN']}"}


def run_client(
    code: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_cli_help_and_version():
    out = subprocess.run(
        [sys.executable, "-m", "rgpu_server", "--help"], capture_output=True, text=True, check=True
    )
    for flag in ("--host", "--port", "--device", "--log-level"):
        assert flag in out.stdout
    out = subprocess.run(["rgpu-server", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("rgpu-server ")


@pytest.mark.parametrize(
    "entry", [[sys.executable, "-m", "rgpu_server"], ["rgpu-server"]], ids=["module", "script"]
)
def test_openmp_threads_sleep_between_ops_unless_told_otherwise(entry):
    """The server's OpenMP pool must not spin between ops (it took two thirds of a CPU server's
    time and the cores of a client beside it). libgomp prints what it read at start-up."""

    def spincount(**env: str) -> str:
        out = subprocess.run(
            [*entry, "--version"],
            capture_output=True,
            text=True,
            check=True,
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("OMP_")},
                "OMP_DISPLAY_ENV": "VERBOSE",
                **env,
            },  # fmt: skip
        )
        found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
        assert found, f"this torch's OpenMP runtime is not libgomp: {out.stderr[-500:]}"
        return found.group(1)

    assert spincount() == "0"
    assert int(spincount(OMP_WAIT_POLICY="ACTIVE")) > 0  # the user's choice stands


def test_threads_sets_the_kernels_threads_and_refuses_nonsense(start_server):
    """--threads: a CPU server beside its client leaves it a core (a step of a small Hugging Face
    model took up to 1.7x as long with a kernel thread on every core of this 2-core machine)."""
    srv = start_server("--threads", "1")
    out = run_client(
        f"""
        import torch, rgpu
        print(rgpu.connect({srv.url!r}).device_name)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(", 1 thread a kernel)")
    for bad in ("0", "-2", "many"):
        out = subprocess.run(
            [sys.executable, "-m", "rgpu_server", "--device", "cpu", "--threads", bad],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2
        assert (
            f"argument --threads: {bad!r} is not a number of threads: give 1 or more" in out.stderr
        )


@pytest.mark.parametrize(
    "device, message",
    [
        ("tpu", "must be cpu, cuda, cuda:N or mps"),
        ("cuda", "no CUDA GPU"),
        ("nonsense:x", "must be cpu, cuda, cuda:N or mps"),
    ],
)
def test_bad_device_is_a_clear_error(device, message):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    out = subprocess.run(
        [sys.executable, "-m", "rgpu_server", "--device", device, "--port", "0"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_port_in_use_is_a_clear_error(server):
    port = server.url.rsplit(":", 1)[1]
    out = subprocess.run(
        [sys.executable, "-m", "rgpu_server", "--device", "cpu", "--port", port],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr


def test_logs_startup_and_sessions_but_not_ops(start_server):
    srv = start_server()
    out = run_client(
        f"""
        import torch, rgpu
        rgpu.connect({srv.url!r})
        x = torch.ones(100, device="rgpu")
        for _ in range(50):
            x = x + 1
        print(x.sum().item())
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "5100.0"
    deadline = time.time() + 10
    while "ended for" not in srv.log() and time.time() < deadline:
        time.sleep(0.05)
    log = srv.log()
    assert re.search(r"listening on ws://127\.0\.0\.1:\d+ \(device cpu", log)
    assert re.search(r"session \w+ started for 127\.0\.0\.1:\d+ \(rgpu [\d.]+, torch 2\.\d+", log)
    assert re.search(r"session \w+ ended for 127\.0\.0\.1:\d+ after \d+ ops", log)
    assert len(log.splitlines()) <= 4  # nothing per op


def server_tensors() -> int:
    """Tensors the server holds for all its sessions (one wait on the current session)."""
    return rgpu.session_info()["server"]["tensors"]


def wait_for_server_tensors(n: int, timeout: float = 60) -> None:
    """Until the server holds `n` tensors: another session's worker has run its first ops."""
    deadline = time.time() + timeout
    while server_tensors() < n:
        assert time.time() < deadline, f"the server never held {n} tensors"
        time.sleep(0.02)


def test_a_long_kernel_does_not_stall_other_sessions(server):
    other = rgpu.connect(server.url)
    before = server_tensors()
    busy = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            f"""
            import sys, torch, rgpu
            rgpu.connect({server.url!r})
            a = torch.randn(1500, 1500, device="rgpu")
            for _ in range(40):
                a = (a @ a).tanh()
            torch.rgpu.synchronize()
            print("done", flush=True)
            """
        )],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        # the busy session's worker has made `a`: its matmuls come next, seconds of them
        wait_for_server_tensors(before + 1)
        t0 = time.perf_counter()
        assert (torch.arange(10.0, device="rgpu") * 2).sum().item() == 90.0
        elapsed = time.perf_counter() - t0
        assert busy.poll() is None, "the busy client should still be running"
        assert elapsed < 5.0, f"another session waited {elapsed:.1f}s behind a busy one"
        del other
    finally:
        busy.wait(timeout=300)
        assert busy.stdout.readline().strip() == "done"


def test_hostile_frames_close_only_that_connection(dev, server):
    with ws_connect(server.url, compression=None, additional_headers=AUTH) as raw:
        _hostile_exchange(raw)
    # the shared session is untouched
    assert torch.ones(3, device=dev).sum().item() == 3.0


def _hostile_exchange(raw) -> None:
    raw.send(
        p.hello_frame(
            {"protocol": p.PROTOCOL_VERSION, "torch": torch.__version__, "client": "fuzz"}
        )
    )
    assert p.frame_kind(raw.recv(timeout=10)) == p.Frame.WELCOME
    raw.send(b"\x01\xff\xff garbage")
    seq, status, value = p.parse_reply(raw.recv(timeout=10))
    assert (seq, status) == (0, p.Status.PROTOCOL)
    assert "sequence number" in value or "malformed" in value
    with pytest.raises(ConnectionClosed):
        raw.recv(timeout=10)
    assert raw.close_code == p.CloseCode.PROTOCOL_ERROR


@pytest.mark.parametrize(
    "first, refusal, close_code",
    [
        (b"GET / HTTP/1.1", None, p.CloseCode.BAD_HELLO),
        (b"\x20\xc1", None, p.CloseCode.BAD_HELLO),
        (
            p.hello_frame({"protocol": 999, "torch": "2.13.0"}),
            "protocol",
            p.CloseCode.VERSION_MISMATCH,
        ),
        ("text frame", None, p.CloseCode.BAD_HELLO),
    ],
)
def test_bad_handshakes_are_refused(server, first, refusal, close_code):
    """A HELLO the server can read but not accept gets a WELCOME that says why, then the close;
    anything else is closed at once."""
    with ws_connect(server.url, compression=None, additional_headers=AUTH) as raw:
        raw.send(first)
        if refusal is not None:
            assert p.parse_handshake(raw.recv(timeout=10), p.Frame.WELCOME)["refused"] == refusal
        with pytest.raises(ConnectionClosed):
            raw.recv(timeout=10)
        assert raw.close_code == close_code


def test_torch_version_mismatch_is_refused_unless_overridden(server, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    with pytest.raises(rgpu.ConnectError) as info:
        rgpu.connect(server.url)
    msg = str(info.value)
    assert "2.11.0" in msg and "2.13" in msg and "RGPU_ALLOW_VERSION_MISMATCH=1" in msg
    monkeypatch.setenv("RGPU_ALLOW_VERSION_MISMATCH", "1")
    rgpu.connect(server.url)
    assert torch.ones(2, device="rgpu").sum().item() == 2.0


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(rgpu.ConnectError, match="cannot reach an rgpu server at ws://127.0.0.1:9"):
        rgpu.connect("ws://127.0.0.1:9", timeout=2)
    with pytest.raises(rgpu.ConnectError, match="ws:// or wss://"):
        rgpu.connect("http://example.invalid:80")


def test_rgpu_server_env_is_used_when_no_url_is_given(server):
    out = run_client(
        """
        import torch, rgpu
        print((torch.ones(4, device="rgpu") * 2).sum().item())
        import rgpu.current
        print(rgpu.current.get().url)
        """,
        env={"RGPU_SERVER": server.url},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["8.0", server.url]
    assert "embedded" not in out.stderr


@pytest.mark.parametrize("threads", [None, "3"], ids=["default", "RGPU_LOCAL_THREADS"])
def test_embedded_server_starts_on_first_use_and_stops_with_the_client(threads):
    env = {k: v for k, v in os.environ.items() if k not in ("RGPU_SERVER", "RGPU_LOCAL_THREADS")}
    if threads is not None:
        env["RGPU_LOCAL_THREADS"] = threads
    code = """
        import os, torch, rgpu
        import rgpu.current
        x = torch.ones(4, device="rgpu")
        print((x * 2).sum().item())
        print(rgpu.current.get().local_process.process.pid, flush=True)
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    value, pid = out.stdout.split()
    assert value == "8.0"
    assert "started an embedded rgpu server at ws://127.0.0.1:" in out.stderr
    # its kernels leave this process a core, unless RGPU_LOCAL_THREADS says otherwise
    n = int(threads) if threads else max(1, len(os.sched_getaffinity(0)) - 1)
    assert f"{n} thread{'s' * (n != 1)} a kernel)" in out.stderr
    assert _gone(int(pid))


def test_embedded_server_dies_with_a_killed_client():
    env = {k: v for k, v in os.environ.items() if k != "RGPU_SERVER"}
    code = """
        import sys, time, torch, rgpu
        import rgpu.current
        rgpu.connect("local")
        print(rgpu.current.get().local_process.process.pid, flush=True)
        time.sleep(600)
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    pid = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _gone(pid)


def _gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie child of ours counts as gone
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_aten_dunder_operators_resolve_and_other_dunder_names_are_refused():
    """`t << 1` is `aten::__lshift__.Scalar`: refused as "not an aten operator name", it failed
    at the next sync. Only aten's own dunder operators resolve; any other name with `__` is
    refused before it is looked up."""
    from rgpu_server import ops

    for name in ["__lshift__.Scalar", "__rshift__.Tensor", "__ilshift__.Scalar", "__irshift__.Tensor",
                 "__lshift__.Tensor_out", "__and__.Tensor"]:  # fmt: skip
        assert ops.resolve(name).label == f"aten::{name}"
    for name in ["__class__.x", "__init__.Scalar", "__dict__.Tensor", "__getattr__.Scalar",
                 "add.__Tensor", "add.__class__", "__lshift__.__x__", "_x__y.Tensor",
                 "__lshift__.nope", "__LSHIFT__.Scalar"]:  # fmt: skip
        with pytest.raises(ops.OpRefused):
            ops.resolve(name)
