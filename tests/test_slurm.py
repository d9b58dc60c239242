"""A GPU from a Slurm cluster (`slurm://`), against a real Slurm and a real OpenSSH server.

tests/slurm_cluster.py starts munged, slurmctld and slurmd for one node (``rgpu-node``) on
loopback; tests/ssh_host.py starts sshd, which plays the login node and, through it, the compute
node (``ssh -J``): both are this machine. Jobs run real `rgpu-server` processes (on the CPU)
found on the PATH the job inherits from the SSH session. Nothing is mocked.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster
import ssh_host
import torch
import torch.nn.functional as F
from slurm_cluster import NODE, SlurmCluster
from ssh_host import SshHost, accepts, free_port

import rgpu
import rgpu.slurm
from rgpu.models import seed_mlp
from rgpu.slurm import SlurmTransport
from rgpu.slurm_target import (
    JobFailed,
    NodeUnreachable,
    SlurmError,
    SlurmMissing,
    SlurmRefused,
    job_script,
    parse_duration,
    parse_slurm_url,
    parse_state,
)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cluster, the login node's sshd, and RGPU_SSH_COMMAND pointing at its config."""
    for why in (ssh_host.missing(), slurm_cluster.missing()):
        if why:
            pytest.skip(why)
    d = tmp_path_factory.mktemp("slurm")
    (d / "cluster").mkdir()
    try:
        c = SlurmCluster(d / "cluster")
    except RuntimeError as e:
        pytest.skip(str(e))
    nobin = d / "noslurm-bin"  # a login node without Slurm: a PATH with only sh on it
    nobin.mkdir()
    os.symlink("/bin/sh", nobin / "sh")
    (d / "ssh").mkdir()
    noslurm_port = free_port()
    node = f"Host {NODE}\n  HostName 127.0.0.1\n  Port {{port}}\n  User {{user}}\n  IdentityFile {{dir}}/user_key\n"
    host = SshHost(
        d / "ssh",
        setenv=c.env,
        ports=(noslurm_port,),
        sshd_extra=f"Match LocalPort {noslurm_port}\n  SetEnv PATH={nobin}\n",
        client_extra=node
        + f"Host rgpu-noslurm\n  HostName 127.0.0.1\n  Port {noslurm_port}\n  User {{user}}\n"
        "  IdentityFile {dir}/user_key\n",
    )
    # the same client config, but the node's sshd is not where it says: the node is unreachable
    cut = d / "ssh" / "ssh_config_cut"
    cut.write_text(
        host.config.read_text().replace(
            f"Host {NODE}\n  HostName 127.0.0.1\n  Port {host.port}",
            f"Host {NODE}\n  HostName 127.0.0.1\n  Port {free_port()}",
        )
    )
    old = os.environ.get("RGPU_SSH_COMMAND")
    os.environ["RGPU_SSH_COMMAND"] = host.ssh_command
    yield {"cluster": c, "host": host, "dir": d, "cut": f"ssh -F {cut}"}
    rgpu.disconnect()
    if old is None:
        os.environ.pop("RGPU_SSH_COMMAND", None)
    else:
        os.environ["RGPU_SSH_COMMAND"] = old
    host.stop()
    c.stop()


@pytest.fixture
def slurm(cluster, tmp_path):
    """No session before; after the test none left, no transport alive, no job in the queue."""
    rgpu.disconnect()
    cluster["workdir"] = str(tmp_path / "jobs")
    yield cluster
    rgpu.disconnect()
    assert not rgpu.slurm._LIVE, "a Slurm transport outlived its session"
    c = cluster["cluster"]
    c.wait_idle(20)
    assert not c.jobs(), f"jobs left in the queue: {c.jobs()}"


def train(device: str, steps: int = 4) -> list[float]:
    torch.manual_seed(0)
    model = seed_mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(64, 16).to(device), torch.randn(64, 1).to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def final_state(c: SlurmCluster, job: str, timeout: float = 30) -> str:
    """The job's squeue state once it is no longer running or completing."""
    deadline = time.time() + timeout
    while c.state(job).split("|")[0] in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
        if time.time() > deadline:
            break
        time.sleep(0.2)
    return c.state(job)


def proc_texts(what: str) -> dict[int, bytes]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out[int(pid)] = Path(f"/proc/{pid}/{what}").read_bytes()
        except OSError:
            pass
    return out


def test_slurm_urls_scripts_and_squeue_lines_parse():
    t = parse_slurm_url(
        "slurm://alice@login.example:2222?partition=gpu&gres=gpu:1&time=02:00:00&cpus=4"
        "&sbatch=--exclusive --comment=x&idle=600",
        {"account": "proj", "qos": None},
    )
    assert (t.login.destination, t.login.ssh_port, t.partition, t.idle) == (
        "alice@login.example", 2222, "gpu", 600.0)  # fmt: skip
    assert t.sbatch_args() == ["--partition=gpu", "--gres=gpu:1", "--cpus-per-task=4",
                               "--time=02:00:00", "--account=proj", "--exclusive", "--comment=x"]  # fmt: skip
    for bad, match in [
        ("slurm://-oProxyCommand=x", "does not name an SSH host"),
        ("slurm://h?colour=red", "unknown slurm option"),
        ("slurm://h?cpus=many", "cpus must be a whole number"),
        ("slurm://h?job=12;rm", "job must be a Slurm job id"),
        ("slurm://h?sbatch=--output=/tmp/x", "rgpu's to set"),
        ("slurm://h?partition=", "partition is empty"),
    ]:
        with pytest.raises(rgpu.ConnectError, match=match):
            parse_slurm_url(bad)
    assert [parse_duration(s) for s in ("0:55", "1:02:03", "2-01", "1-00:00:10", "UNLIMITED")] == [
        55.0, 3723.0, 176400.0, 86410.0, None]  # fmt: skip
    s = parse_state("PENDING|Resources||1:00:00")
    assert (s.state, s.ended, s.describe(), s.time_left) == (
        "PENDING", False, "PENDING (Resources)", 3600.0)  # fmt: skip
    assert parse_state("slurm_load_jobs error: Invalid job id specified").ended
    busy = parse_state("slurm_load_jobs error: Socket timed out on send/recv operation")
    assert not busy.ended and busy.describe().startswith("unknown (squeue said: slurm_load_jobs")
    assert parse_state("TIMEOUT|TimeLimit|n1|INVALID").describe() == "TIMEOUT (TimeLimit)"
    # a hostile device name stays one word for the job's shell
    script = job_script(parse_slurm_url("slurm://h?device=cuda; rm -rf ~"), idle=60)
    assert "--device 'cuda; rm -rf ~'" in script and "--idle-exit 60" in script


def test_idle_exit_stops_a_server_its_client_no_longer_uses(server, start_server):
    rgpu.connect(server.url)  # (the first connect of a process warms up torch for a while)
    srv = start_server("--idle-exit", "3")
    session = rgpu.connect(srv.url)
    for _ in range(5):  # in use: it stays
        assert torch.ones(2, device="rgpu").sum().item() == 2
        time.sleep(1)
    assert srv.proc.poll() is None
    t0 = time.time()
    assert srv.proc.wait(15) == 0 and 2 < time.time() - t0 < 8
    assert "no client used this server for 3 s (--idle-exit)" in srv.wait_log("idle")
    with pytest.raises(rgpu.ConnectionLost, match="shut down"):
        torch.ones(2, device="rgpu").sum().item()
    assert session.state == "lost"


def test_idle_exit_waits_less_for_a_first_client_that_never_comes():
    """A client killed while its job was queued never connects: the server stops after
    `first` seconds rather than the whole idle time."""
    from rgpu_server import idle

    class Registry:
        def sessions(self) -> list:
            return []

    class Server:
        registry = Registry()
        stopped_at = None

        def stop(self):
            self.stopped_at = time.monotonic()

    srv, t0 = Server(), time.monotonic()
    idle.watch(srv, seconds=3600, first=0.5).join(5)
    assert srv.stopped_at is not None and srv.stopped_at - t0 < 2


def test_a_job_starts_trains_like_the_cpu_and_disconnect_cancels_it(slurm, caplog):
    caplog.set_level(logging.INFO, logger="rgpu")
    c = slurm["cluster"]
    t0 = time.perf_counter()
    session = rgpu.connect("slurm://rgpu-test?partition=debug&time=30")
    first = torch.ones(1, device="rgpu").add(1).item()
    first_op_s = time.perf_counter() - t0
    assert first == 2.0
    transport = session.transport
    assert isinstance(transport, SlurmTransport) and transport.node == NODE
    job = transport.job.id
    assert c.state(job) == "RUNNING|None"
    said = "\n".join(caplog.messages)
    assert f"submitted Slurm job {job} to rgpu-test" in said
    assert f"Slurm job {job}: RUNNING on {NODE}; starting rgpu-server there" in said
    assert (
        f"connected through Slurm: 127.0.0.1:{transport.tunnel.local_port} -> Slurm job {job}"
        in said
    )
    torch.testing.assert_close(train("rgpu"), train("cpu"))
    # the token: in no command line, no environment, no file (the job deleted it), no log
    token = session.token
    assert len(token) >= 40
    for what in ("cmdline", "environ"):
        assert not [p for p, text in proc_texts(what).items() if token.encode() in text], what
    directory = Path(transport.job.directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert sorted(p.name for p in directory.iterdir()) == ["job.out"]
    output = (directory / "job.out").read_text()
    assert "listening on ws://127.0.0.1:" in output and token not in output
    assert token not in caplog.text + c.log("slurmctld.log") + c.log("slurmd.log")
    timings = transport.timings
    print(f"\nslurm connect: {first_op_s:.2f} s to the first op; phases " +
          ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()))  # fmt: skip
    assert timings["total"] < first_op_s
    # disconnect: the tunnel closes, the job is cancelled, its directory is gone
    rgpu.disconnect()
    assert not accepts(transport.tunnel.local_port)
    assert final_state(c, job) == "CANCELLED|None" and not directory.exists()


def test_a_pending_job_shows_its_state_and_ctrl_c_cancels_it(slurm):
    c = slurm["cluster"]
    blocker = c.run("sbatch", "--parsable", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 300")
    assert blocker.returncode == 0, blocker.stderr
    blocker = blocker.stdout.strip()
    code = f"import rgpu\nrgpu.connect('slurm://rgpu-test?workdir={slurm['workdir']}')\n"
    p = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in p.stderr:
            seen.append(line)
            if "PENDING (" in line:
                break
        job = seen[0].split("Slurm job ")[1].split()[0]
        assert f"rgpu: Slurm job {job}: PENDING (Resources)" in "".join(seen), seen
        assert c.state(job).startswith("PENDING")
        p.send_signal(signal.SIGINT)
        rest = p.stderr.read()
        assert p.wait(30) != 0
    finally:
        p.kill()
        c.run("scancel", blocker)
    assert f"rgpu: cancelled Slurm job {job}" in rest and "KeyboardInterrupt" in rest, rest
    assert final_state(c, job).startswith("CANCELLED|")
    assert not list(Path(slurm["workdir"]).iterdir())  # its directory (and token file) are gone


def test_a_job_cancelled_mid_session_ends_it_with_slurms_reason(slurm):
    c = slurm["cluster"]
    session = rgpu.connect(f"slurm://rgpu-test?workdir={slurm['workdir']}")
    x = torch.arange(6.0, device="rgpu")
    assert x.sum().item() == 15
    job = session.transport.job.id
    assert c.run("scancel", job).returncode == 0  # an admin, or the user in another terminal
    with pytest.raises(rgpu.SessionLost) as info:
        for _ in range(100):
            (x * 2).sum().item()
            time.sleep(0.1)
    msg = str(info.value)
    assert f"Slurm job {job} on {NODE} ended (CANCELLED" in msg and "rgpu.connect()" in msg
    assert f"JOB {job} ON {NODE} CANCELLED AT" in msg  # slurmstepd's own line, from the output
    assert session.state == "lost"
    rgpu.disconnect()
    assert final_state(c, job).startswith("CANCELLED|")


def test_a_job_unused_past_its_idle_time_ends_by_itself_and_says_so(slurm):
    c = slurm["cluster"]
    session = rgpu.connect(f"slurm://rgpu-test?idle=4&workdir={slurm['workdir']}")
    job = session.transport.job.id
    assert torch.ones(3, device="rgpu").sum().item() == 3
    assert final_state(c, job, timeout=30).startswith("COMPLETED|")  # nobody cancelled it
    with pytest.raises(rgpu.SessionLost) as info:
        torch.ones(3, device="rgpu").sum().item()
    msg = str(info.value)
    assert f"Slurm job {job} on {NODE} ended (COMPLETED)" in msg
    assert "no client used this server for 4 s (--idle-exit)" in msg


def test_errors_name_the_cause(slurm):
    c = slurm["cluster"]
    workdir = slurm["workdir"]
    with pytest.raises(
        SlurmMissing, match=r"no Slurm on rgpu-noslurm: `sbatch` is not on the PATH"
    ):
        rgpu.connect("slurm://rgpu-noslurm")
    with pytest.raises(SlurmRefused) as info:
        rgpu.connect(f"slurm://rgpu-test?partition=nosuch&workdir={workdir}")
    msg = str(info.value)
    assert "sbatch on rgpu-test refused the job" in msg and "Invalid partition name" in msg
    assert "--partition=nosuch" in msg
    assert not list(Path(workdir).iterdir()) and not c.jobs()
    # the job runs, but its server fails: the tail of its output says why
    fails = f"{sys.executable} -c 'import sys; sys.exit(\"no GPU here, says the server\")'"
    with pytest.raises(JobFailed) as info:
        rgpu.connect(
            f"slurm://rgpu-test?workdir={workdir}", slurm_options={"server_command": fails}
        )
    msg = str(info.value)
    assert "ended (FAILED" in msg and "before its rgpu-server listened" in msg
    assert "no GPU here, says the server" in msg
    with pytest.raises(rgpu.ssh.ServerMissing, match="/nonexistent/rgpu-server"):
        rgpu.connect(f"slurm://rgpu-test?server_command=/nonexistent/rgpu-server&workdir={workdir}")
    # the server listens, but the node cannot be reached through the login node
    with pytest.raises(NodeUnreachable) as info:
        rgpu.connect(
            f"slurm://rgpu-test?workdir={workdir}", slurm_options={"ssh_command": slurm["cut"]}
        )
    msg = str(info.value)
    assert "could not be reached through rgpu-test" in msg and "The job is cancelled" in msg
    job = msg.split("Slurm job ")[1].split()[0]
    assert final_state(c, job).startswith("CANCELLED|")
    assert rgpu.current_session() is None  # no failed connect left a session behind


def test_a_job_reaching_its_time_limit_is_warned_about_then_ends_the_session(slurm, caplog):
    c = slurm["cluster"]
    session = rgpu.connect(f"slurm://rgpu-test?partition=short&time=1&workdir={slurm['workdir']}")
    job = session.transport.job.id
    w = torch.ones(3, device="rgpu")
    deadline = time.time() + 10
    while "reaches its time limit" not in caplog.text and time.time() < deadline:
        time.sleep(0.2)
    assert f"Slurm job {job} on {NODE} reaches its time limit in " in caplog.text
    t0 = time.time()
    with pytest.raises(rgpu.SessionLost) as info:
        while time.time() - t0 < 150:
            w = w + 1
            w.sum().item()
            time.sleep(0.5)
    msg = str(info.value)
    assert f"Slurm job {job} on {NODE} ended (TIMEOUT (TimeLimit))" in msg
    assert "DUE TO TIME LIMIT" in msg
    print(f"\ntime limit: the session ended {time.time() - t0:.0f} s after connect")
    rgpu.disconnect()
    assert final_state(c, job).startswith("TIMEOUT|")


def test_a_running_job_of_yours_is_used_and_not_cancelled(slurm):
    c = slurm["cluster"]
    mine = c.run("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 300").stdout.strip()
    try:
        session = rgpu.connect(f"slurm://rgpu-test?job={mine}")
        transport = session.transport
        assert transport.node == NODE and transport.server is not None
        a = torch.randn(8, 8)
        torch.testing.assert_close((a.to("rgpu") @ a.to("rgpu")).cpu(), a @ a)
        rgpu.disconnect()
        assert not transport.server.alive  # the step ended with its SSH session...
        time.sleep(1)
        assert c.state(mine) == "RUNNING|None"  # ...and the job is still yours
        with pytest.raises(SlurmError, match="is not running"):
            rgpu.connect("slurm://rgpu-test?job=999999")
    finally:
        c.run("scancel", mine)


def test_rgpu_run_slurm_runs_a_script_in_a_job_and_cancels_it_after(slurm):
    c = slurm["cluster"]
    code = "import torch, rgpu\nprint('value', torch.arange(4.0, device='rgpu').sum().item())\nraise SystemExit(3)"
    done = subprocess.run(
        [sys.executable, "-m", "rgpu_run", "--slurm", "rgpu-test", "--partition", "debug",
         "--time", "5", "--sbatch=--comment=rgpu-run", "--", sys.executable, "-c", code],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "RGPU_SLURM_IDLE_SECONDS": "300"},
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "value 6.0" in done.stdout
    job = done.stderr.split("rgpu-run: submitted Slurm job ")[1].split()[0]
    assert f"rgpu-run: Slurm job {job}: RUNNING on {NODE}" in done.stderr
    assert final_state(c, job).startswith("CANCELLED|")
    bad = subprocess.run(
        [sys.executable, "-m", "rgpu_run", "--slurm", "rgpu-test", "--partition", "nosuch",
         "--", "true"], cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 255 and "Invalid partition name" in bad.stderr
    usage = subprocess.run([sys.executable, "-m", "rgpu_run", "--host", "h", "--partition", "p",
                            "--", "true"], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert usage.returncode == 2 and "Slurm options need --slurm" in usage.stderr


def test_a_script_that_exits_leaves_no_job_and_percent_rgpu_connects(slurm, capsys):
    """RGPU_SERVER=slurm://... connects on first use; exiting without disconnect cancels."""
    c = slurm["cluster"]
    code = "import torch, rgpu\nprint(torch.ones(2, device='rgpu').sum().item(), rgpu.current_session().transport.job.id)"
    env = {**os.environ, "RGPU_SERVER": f"slurm://rgpu-test?workdir={slurm['workdir']}"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    value, job = done.stdout.split()
    assert value == "2.0" and final_state(c, job).startswith("CANCELLED|")
    import IPython
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython() or IPython.get_ipython()
    ip.run_line_magic("load_ext", "rgpu_jupyter")
    capsys.readouterr()
    ip.run_line_magic("rgpu", f"connect slurm://rgpu-test?workdir={slurm['workdir']}")
    out = capsys.readouterr()
    assert "rgpu: connected to ws://127.0.0.1:" in out.out, out
    job = rgpu.current_session().transport.job.id
    ip.run_line_magic("rgpu", "disconnect")
    assert final_state(c, job).startswith("CANCELLED|")
