"""Reaching a GPU host over SSH, against a real OpenSSH server.

The test starts Debian's `sshd` on a loopback port (tests/ssh_host.py); the "GPU host" is this
machine. The client uses the system `ssh` with a generated config (`RGPU_SSH_COMMAND="ssh -F
CONFIG"`), so nothing here is mocked: tunnels, the rgpu-server started on the host, and the token
handed over on the SSH session's stdin are all real.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from loops import mlp_losses
from rgpu_test_servers import TOKEN_FOR_TESTS, port_of
from ssh_host import SshHost, accepts, free_port, missing

import rgpu
import rgpu.ssh
from rgpu.ssh import SshTunnel, parse_ssh_url

ROOT = Path(__file__).resolve().parent.parent


def cmdlines() -> dict[int, str]:
    """Every process's command line (what `ps` shows), by pid."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                out[int(d)] = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                pass
    return out


def listener(port: int) -> int | None:
    """The pid of the process listening on 127.0.0.1:port (other test runs may share this
    machine, so servers are found by their port, not by counting processes)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":  # LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


def exited(pid: int, timeout: float = 15) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real sshd on 127.0.0.1:PORT; yields what reaches it (RGPU_SSH_COMMAND is its config)."""
    why = missing()
    if why:
        pytest.skip(why)
    try:
        host = SshHost(tmp_path_factory.mktemp("sshd"))
    except RuntimeError as e:
        pytest.skip(str(e))
    old = os.environ.get("RGPU_SSH_COMMAND")
    os.environ["RGPU_SSH_COMMAND"] = host.ssh_command
    yield {"dir": host.dir, "port": host.port, "user": host.user}
    rgpu.disconnect()
    if old is None:
        os.environ.pop("RGPU_SSH_COMMAND", None)
    else:
        os.environ["RGPU_SSH_COMMAND"] = old
    host.stop()


@pytest.fixture
def fresh(sshd):
    """No session before the test; none left after it, and no tunnel or server leaked."""
    rgpu.disconnect()
    yield sshd
    rgpu.disconnect()
    assert not rgpu.ssh._LIVE, "a tunnel outlived its session"


def test_ssh_urls_parse_and_refuse_what_ssh_would_misread():
    t = parse_ssh_url("ssh://alice@gpu.example:2222?port=9721&identity=~/k&start=no&device=cuda:1")
    assert (t.destination, t.ssh_port, t.port, t.start, t.device) == (
        "alice@gpu.example",
        2222,
        9721,
        "no",
        "cuda:1",
    )
    assert t.identity == os.path.expanduser("~/k")
    assert parse_ssh_url("ssh://gpubox").destination == "gpubox"  # an ~/.ssh/config alias
    assert parse_ssh_url("ssh://bob@[::1]:22").destination == "bob@::1"
    assert parse_ssh_url("ssh://h?port=1", {"port": 2, "start": None}).port == 2  # keywords win
    for bad, match in [
        ("ssh://-oProxyCommand=x", "does not name an SSH host"),
        ("ssh://a@h?start=maybe", "start must be one of"),
        ("ssh://a@h?colour=red", "unknown ssh option"),
        ("ssh://a@h?port=99999", "is not a TCP port"),
    ]:
        with pytest.raises(rgpu.ConnectError, match=match):
            parse_ssh_url(bad)


def test_connect_over_ssh_to_a_running_server_runs_ops_like_the_cpu(fresh, server):
    """ssh://user@host:sshport?identity=KEY&port=P: the tunnel reaches a server already running."""
    key = fresh["dir"] / "user_key"
    url = (
        f"ssh://{fresh['user']}@127.0.0.1:{fresh['port']}?identity={key}&port={port_of(server.url)}"
    )
    session = rgpu.connect(url + "&start=no")  # RGPU_TOKEN is the running server's token
    tunnel = session.transport
    assert isinstance(tunnel, SshTunnel) and tunnel.existing and tunnel.server is None
    assert session.url == tunnel.url != server.url
    torch.manual_seed(0)
    a, b = torch.randn(16, 8), torch.randn(8, 4)
    got = (a.to("rgpu") @ b.to("rgpu")).relu().softmax(1).cpu()
    torch.testing.assert_close(got, (a @ b).relu().softmax(1))
    assert torch.arange(10, device="rgpu").sum().item() == 45
    rgpu.disconnect()
    assert not tunnel.alive and not accepts(tunnel.local_port)


def test_a_server_is_started_on_the_host_without_the_token_in_any_process_list(fresh, caplog):
    nothing = free_port()  # start=auto: nothing listens on this port of the host, so start one
    session = rgpu.connect(f"ssh://rgpu-test?port={nothing}")
    tunnel = session.transport
    assert tunnel.server is not None and tunnel.remote_port != nothing
    pid = listener(tunnel.remote_port)
    assert pid and "--token-stdin" in cmdlines()[pid]
    token = tunnel.server.token
    assert session.token == token and len(token) >= 40
    assert not [pid for pid, cmd in cmdlines().items() if token in cmd], "token in a command line"
    for other in os.listdir("/proc"):  # nor in any process's environment
        try:
            env = Path(f"/proc/{other}/environ").read_bytes()
        except OSError:
            continue
        assert token.encode() not in env, f"token in the environment of {other}"
    x = torch.linspace(-2, 2, 50)
    torch.testing.assert_close(torch.tanh(x.to("rgpu") * 3).cpu(), torch.tanh(x * 3))
    log = tunnel.server.log()
    assert "listening on ws://127.0.0.1:" in log and token not in log
    assert token not in caplog.text
    # the server's life is its SSH session's: when that ssh dies, the server shuts down and the
    # session ends with a clear error at the next wait (no 60 s of futile reconnects)
    tunnel.server.process.kill()
    deadline = time.time() + 15
    while session.state == "connected" and time.time() < deadline:
        time.sleep(0.05)
    with pytest.raises((rgpu.ConnectionLost, rgpu.SessionLost), match="shut down|has exited"):
        torch.ones(3, device="rgpu").sum().item()
    assert exited(pid)


def test_a_killed_tunnel_is_reopened_and_training_resumes_with_identical_losses(fresh):
    session = rgpu.connect("ssh://rgpu-test?start=yes")
    tunnel = session.transport
    clean = mlp_losses(12)
    pids = []

    def kill_tunnel(step: int) -> None:
        if step in (2, 5, 9):
            pids.append(tunnel.process.pid)
            os.kill(tunnel.process.pid, signal.SIGKILL)

    cut = mlp_losses(12, kill_tunnel)
    assert cut == clean, "losses after killed tunnels differ from the uninterrupted run"
    assert session.reconnects == 3 and session.state == "connected"
    assert tunnel.alive and tunnel.process.pid not in pids
    assert tunnel.server.alive  # the server's own SSH session was not touched
    # a server that crashes (no goodbye): the reconnect finds its SSH session ended and gives up
    # at once with SessionLost rather than retrying for RGPU_RECONNECT_SECONDS
    os.kill(listener(tunnel.remote_port), signal.SIGKILL)
    t0 = time.time()
    with pytest.raises(rgpu.SessionLost, match="has exited"):
        for _ in range(200):
            torch.ones(3, device="rgpu").sum().item()
            time.sleep(0.05)
    assert time.time() - t0 < 20


def test_a_host_is_reached_through_a_jump_host_with_its_own_port_and_key(fresh):
    """?jump=user@login:port: a ProxyCommand (`ssh -W`) that carries -p, -i and BatchMode to
    the hop too (ssh's own -J would drop -i); here the hop and the host are the same sshd."""
    key = fresh["dir"] / "user_key"
    hop = f"{fresh['user']}@127.0.0.1:{fresh['port']}"
    t = parse_ssh_url(f"ssh://rgpu-test?jump={hop}&identity={key}")
    assert (t.jump.destination, t.jump.ssh_port, t.jump.identity) == (
        f"{fresh['user']}@127.0.0.1", fresh["port"], str(key))  # fmt: skip
    session = rgpu.connect(f"ssh://rgpu-test?start=yes&jump={hop}&identity={key}")
    proxy = [a for a in session.transport.ssh if a.startswith("ProxyCommand=")]
    assert proxy and f"-p {fresh['port']}" in proxy[0] and f"-i {key}" in proxy[0]
    assert torch.arange(4, device="rgpu").sum().item() == 6
    rgpu.disconnect()
    with pytest.raises(rgpu.ssh.SshUnreachable, match="cannot reach rgpu-test"):
        rgpu.connect(f"ssh://rgpu-test?start=yes&jump=127.0.0.1:{free_port()}", timeout=3)


def test_rgpu_run_runs_a_script_through_a_tunnel_and_passes_its_exit_status(sshd):
    # the child also kills rgpu-run's tunnel: rgpu-run re-opens it on the same local port, and
    # the child's session (which knows nothing of SSH) resumes through it
    code = (
        "import os, signal, sys, torch, rgpu\n"
        "x = torch.arange(5.0, device='rgpu')\n"
        "assert x.sum().item() == 10\n"
        "fwd = ('127.0.0.1:' + os.environ['RGPU_SERVER'].rsplit(':', 1)[1] + ':').encode()\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        if b'\\0' + fwd in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
        "            os.kill(int(pid), signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "s = rgpu.current_session()\n"
        "print('value', (x * x).sum().item(), s.url == os.environ['RGPU_SERVER'], s.reconnects)\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "rgpu_run", "--host", "rgpu-test", "--start", "yes",
         "--", sys.executable, "-c", code],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "value 30.0 True 1" in done.stdout, done.stdout + done.stderr
    line = r"rgpu-run: 127\.0\.0\.1:(\d+) -> rgpu-test port (\d+) over SSH \(an rgpu-server"
    m = re.search(line, done.stderr)
    assert m, done.stderr
    assert not accepts(int(m.group(1)))  # the tunnel closed with the child
    assert not accepts(int(m.group(2)))  # and so did the server started for it


def test_exit_without_disconnect_closes_the_tunnel_and_the_server(sshd):
    """RGPU_SERVER=ssh://... in the environment: the lazy connect goes over SSH too."""
    code = (
        "import torch, rgpu\n"
        "v = torch.ones(2, device='rgpu').sum().item()\n"
        "s = rgpu.current_session()\n"
        "print(v, s.url, s.transport.remote_port)"
    )
    env = {**os.environ, "RGPU_SERVER": "ssh://rgpu-test?start=yes"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    value, url, remote_port = done.stdout.split()
    assert value == "2.0" and "connected over SSH" in done.stderr
    assert not accepts(port_of(url)) and not accepts(int(remote_port))


def test_rgpu_run_exit_statuses_environment_and_help_without_torch(server):
    run = [sys.executable, "-m", "rgpu_run"]
    show = "import os; print(os.environ['RGPU_SERVER'], os.environ['RGPU_TOKEN'])"
    done = subprocess.run(
        [*run, "--server", server.url, "--token", "T0k", "--", sys.executable, "-c", show],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, f"{server.url} T0k")
    done = subprocess.run(
        [*run, "--server", server.url, "--", sys.executable, "-c", "raise SystemExit(7)"], cwd=ROOT
    )
    assert done.returncode == 7
    done = subprocess.run(
        [*run, "--server", server.url, "--", "no-such-command-rgpu"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 127 and "command not found" in done.stderr
    assert (
        subprocess.run([*run, "--server", server.url], cwd=ROOT, capture_output=True).returncode
        == 2
    )
    check = "import sys, rgpu_run\ntry: rgpu_run.main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True)
    assert "usage: rgpu-run" in done.stdout and done.stdout.strip().endswith("False")
    # Ctrl-C in a terminal reaches the whole foreground group: the child stops, rgpu-run says 130
    sleeper = "import time; print('ready', flush=True); time.sleep(60)"
    p = subprocess.Popen(
        [*run, "--server", server.url, "--", sys.executable, "-c", sleeper],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert p.stdout.readline().strip() == "ready"
    os.killpg(p.pid, signal.SIGINT)
    assert p.wait(10) == 130


def test_ssh_errors_say_what_went_wrong(fresh, server, monkeypatch):
    with pytest.raises(rgpu.ssh.SshUnreachable, match="cannot reach .*127.0.0.1.*refused"):
        rgpu.connect(f"ssh://{fresh['user']}@127.0.0.1:{free_port()}", timeout=3)
    with pytest.raises(rgpu.ssh.SshUnreachable, match="Could not resolve hostname"):
        rgpu.connect("ssh://nosuchhost.invalid", timeout=3)
    with pytest.raises(rgpu.ssh.SshAuthError, match="refused the SSH login.*identity"):
        rgpu.connect("ssh://rgpu-test-badkey")
    with pytest.raises(rgpu.ssh.SshError, match="host key"):
        rgpu.connect("ssh://rgpu-test-strict")
    with pytest.raises(rgpu.ssh.SshError, match="no ssh client"):
        rgpu.connect("ssh://rgpu-test", ssh_options={"ssh_command": "/nonexistent/ssh"})
    with pytest.raises(rgpu.ConnectError, match=r"nothing listens on port \d+ of rgpu-test"):
        rgpu.connect(f"ssh://rgpu-test?port={free_port()}&start=no")
    with pytest.raises(rgpu.ssh.ServerMissing) as info:
        rgpu.connect("ssh://rgpu-test?start=yes&server_command=/nonexistent/rgpu-server")
    msg = str(info.value)
    assert "/nonexistent/rgpu-server" in msg and "pip install jupyter-rgpu" in msg
    assert "torch 2." in msg and "server_command" in msg
    # a failed connect leaves the current session alone
    session = rgpu.connect(f"ssh://rgpu-test?port={port_of(server.url)}&start=no")
    with pytest.raises(rgpu.ssh.SshAuthError):
        rgpu.connect("ssh://rgpu-test-badkey")
    assert rgpu.current_session() is session and session.state == "connected"
    # torch major.minor differ between the two machines: the handshake's message, through ssh
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    with pytest.raises(rgpu.ConnectError) as info:
        rgpu.connect(f"ssh://rgpu-test?port={port_of(server.url)}&start=no")
    msg = str(info.value)
    assert (
        "torch versions differ" in msg and "2.11.0" in msg and "RGPU_ALLOW_VERSION_MISMATCH" in msg
    )


def test_the_default_server_lookup_says_when_rgpu_server_is_missing(tmp_path):
    """The remote script, run by a local sh with a PATH that has no rgpu-server."""
    (tmp_path / "python3").write_text("#!/bin/sh\nexit 1\n")  # a python without rgpu_server
    (tmp_path / "python3").chmod(0o755)
    script = rgpu.ssh.server_script(parse_ssh_url("ssh://h"))
    done = subprocess.run(
        ["/bin/sh", "-c", script],
        env={"PATH": str(tmp_path)},
        input="",
        capture_output=True,
        text=True,
    )
    assert (done.returncode, done.stdout.strip()) == (127, "RGPU_NO_SERVER")


def test_a_running_server_token_is_read_over_ssh_from_its_token_file(
    fresh, tmp_path, monkeypatch, start_server
):
    """rgpu-server --token-file writes a fresh token (mode 0600) that the ssh client reads back."""
    srv = start_server("--token-file", env={"HOME": str(tmp_path), "RGPU_TOKEN": ""})
    port = port_of(srv.url)
    path = tmp_path / ".config" / "rgpu" / f"token-{port}"
    token = path.read_text().strip()
    assert len(token) >= 40 and token != TOKEN_FOR_TESTS
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert token not in srv.wait_log(str(path)) and "clients connect with" not in srv.log()
    monkeypatch.delenv("RGPU_TOKEN")
    session = rgpu.connect(f"ssh://rgpu-test?port={port}&start=no&token_file={path}")
    assert session.token == token
    assert torch.full((3,), 2.0, device="rgpu").prod().item() == 8.0
    rgpu.disconnect()
    with pytest.raises(rgpu.AuthError, match="--token-file"):
        rgpu.connect(f"ssh://rgpu-test?port={port}&start=no&token_file=/nonexistent")


def test_percent_rgpu_connect_accepts_ssh_urls(fresh, server, capsys):
    import IPython
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython() or IPython.get_ipython()
    ip.run_line_magic("load_ext", "rgpu_jupyter")
    capsys.readouterr()
    ip.run_line_magic("rgpu", f"connect ssh://rgpu-test?port={port_of(server.url)}&start=no")
    out = capsys.readouterr().out
    assert re.match(r"rgpu: connected to ws://127\.0\.0\.1:\d+, cpu", out), out
    assert isinstance(rgpu.current_session().transport, SshTunnel)
    ip.run_line_magic("rgpu", "disconnect")
