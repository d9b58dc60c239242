"""`rgpu-run`: run an unmodified script against a remote GPU.

    rgpu-run --host user@gpuhost -- python train.py --epochs 3
    rgpu-run --slurm user@login --partition gpu --gres gpu:1 --time 2:00:00 -- python train.py
    rgpu-run --server ws://127.0.0.1:9720 --token T -- python train.py

The child gets ``RGPU_SERVER`` (and ``RGPU_TOKEN``) in its environment; `import rgpu` there
connects on first use. With ``--host`` an SSH tunnel (and, when none runs there, an rgpu-server
on the host) lives exactly as long as the child; with ``--slurm`` so does a Slurm job running
rgpu-server (its state is shown while it waits; Ctrl-C then cancels it). Exit status: the
child's (128+N if a signal N ended it, so 130 after Ctrl-C), 127 if the command was not found,
126 if it could not run, 2 for a usage error, 255 when the host, cluster or server could not be
reached.

A top-level module, not part of the `rgpu` package: `rgpu-run --help` and `--server` never import
torch; only `--host` and `--slurm` do (for the tunnel).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rgpu-run",
        usage="rgpu-run [--host [USER@]HOST | --slurm [USER@]LOGIN | --server URL] [options] "
        "[--token T] -- COMMAND [ARGS...]",
        description="Run COMMAND (e.g. python train.py) with the rgpu device on a remote GPU: "
        "RGPU_SERVER and RGPU_TOKEN are set in its environment.",
        epilog="Without --host, --slurm or --server, RGPU_SERVER from the environment is used "
        "(ssh:// and slurm:// URLs included). RGPU_SSH_COMMAND sets the ssh client and its options "
        "(default: ssh).",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--host", metavar="[USER@]HOST", help="reach the GPU host over SSH")
    where.add_argument(
        "--slurm",
        metavar="[USER@]LOGIN",
        help="run rgpu-server as a Slurm job, submitted over SSH to this login node",
    )
    where.add_argument(
        "--server", metavar="URL", help="ws://, wss://, ssh:// or slurm:// URL of a server"
    )
    p.add_argument("--token", help="the server's token (default: RGPU_TOKEN)")
    ssh = p.add_argument_group("with --host (and --slurm: the SSH port, key, client and server)")
    ssh.add_argument("--ssh-port", type=int, metavar="N", help="SSH port of the host")
    ssh.add_argument("-i", "--identity", metavar="KEY", help="SSH private key file")
    ssh.add_argument(
        "--remote-port",
        type=int,
        metavar="P",
        help="port of an rgpu-server already running on the host (default 9720)",
    )
    ssh.add_argument(
        "--start",
        choices=["auto", "yes", "no"],
        help="start rgpu-server on the host: auto (if none listens; default), yes, no",
    )
    ssh.add_argument("--device", help="--device of a server started on the host (e.g. cuda:1)")
    ssh.add_argument(
        "--server-command",
        metavar="CMD",
        help="command that runs rgpu-server on the host (default: rgpu-server, python3 -m "
        "rgpu_server)",
    )
    ssh.add_argument("--ssh-command", metavar="CMD", help="local ssh client and options")
    slurm = p.add_argument_group("with --slurm (sbatch's options of the same names)")
    for name in ("partition", "gres", "gpus", "cpus", "mem", "time", "account", "qos",
                 "constraint"):  # fmt: skip
        flag = "--cpus-per-task" if name == "cpus" else None
        slurm.add_argument(f"--{name}", metavar=name.upper(), help=flag and f"sbatch {flag}")
    slurm.add_argument(
        "--sbatch", metavar="ARGS", help="more sbatch arguments, one string: --sbatch='--exclusive'"
    )
    slurm.add_argument("--job", metavar="ID", help="start the server in this running job of yours")
    slurm.add_argument(
        "--idle", type=float, metavar="S", help="the job ends after S seconds unused (default 3600)"
    )
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no lines about the tunnel or the job"
    )
    p.add_argument("--timeout", type=float, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    return p


def _ssh_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "ssh_port": args.ssh_port,
        "identity": args.identity,
        "port": args.remote_port,
        "start": args.start,
        "device": args.device,
        "server_command": args.server_command,
        "ssh_command": args.ssh_command,
    }


SLURM_ONLY = ("partition", "gres", "gpus", "cpus", "mem", "time", "account", "qos", "constraint",
              "sbatch", "job", "idle")  # fmt: skip


def _slurm_options(args: argparse.Namespace) -> dict[str, Any]:
    options = {name: getattr(args, name) for name in SLURM_ONLY}
    options.update(identity=args.identity, server_command=args.server_command,
                   device=args.device, ssh_command=args.ssh_command)  # fmt: skip
    return options


def _keep_open(tunnel: Any, done: threading.Event) -> None:
    """Re-open the tunnel when its ssh dies: the child reconnects to the same local port."""
    from rgpu import SessionLost

    while not done.wait(0.5):
        if not tunnel.alive:
            try:
                tunnel.ensure()
            except SessionLost as e:  # the server (or its job) is gone for good
                print(f"rgpu-run: {e}", file=sys.stderr)
                return
            except Exception as e:  # the child's reconnect gives up in its own time
                print(f"rgpu-run: {e}", file=sys.stderr)


def _run(command: list[str], env: dict[str, str]) -> int:
    try:
        child = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        print(f"rgpu-run: {command[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as e:
        print(f"rgpu-run: {command[0]}: {e.strerror or e}", file=sys.stderr)
        return 126

    def forward(signum: int, _frame: Any) -> None:
        child.send_signal(signum)

    # SIGTERM/SIGHUP to rgpu-run (a scheduler, a closed terminal) go on to the child; Ctrl-C
    # already reaches the child through the terminal's process group, so it is not sent twice
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            rc = child.wait()
            break
        except KeyboardInterrupt:
            continue  # the child got the same Ctrl-C; its exit status says what it did
    return 128 - rc if rc < 0 else rc


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command to run (put it after --)")
    server = args.server or (None if (args.host or args.slurm) else os.environ.get("RGPU_SERVER"))
    if args.host:
        server = "ssh://" + args.host
    elif args.slurm:
        server = "slurm://" + args.slurm
        if args.ssh_port:
            server += f":{args.ssh_port}"
    scheme = (server or "").split("://")[0].lower() if "://" in (server or "") else ""
    if scheme != "slurm" and any(getattr(args, n) is not None for n in SLURM_ONLY):
        p.error("Slurm options need --slurm (or a slurm:// --server)")
    if scheme == "slurm" and (args.remote_port or args.start):
        p.error("--remote-port and --start are for --host; a Slurm job starts its own server")
    if scheme == "slurm" and args.token:
        p.error("a Slurm job makes its own token: leave --token out")
    if scheme not in ("ssh", "slurm") and any(v is not None for v in _ssh_options(args).values()):
        p.error("SSH options need --host or --slurm (or an ssh:// or slurm:// --server)")
    if not server:
        p.error(
            "say where the GPU is: --host [USER@]HOST, --slurm [USER@]LOGIN or --server URL (or "
            "set RGPU_SERVER)"
        )
    env = dict(os.environ)
    token = args.token or os.environ.get("RGPU_TOKEN")
    if scheme not in ("ssh", "slurm"):
        env["RGPU_SERVER"] = server
        if args.token:
            env["RGPU_TOKEN"] = args.token
        return _run(command, env)

    from rgpu import RgpuError
    from rgpu.config import Config

    def say(line: str) -> None:
        if not args.quiet:
            print(f"rgpu-run: {line}", file=sys.stderr, flush=True)

    try:
        config = Config.from_env()
        if scheme == "slurm":
            from rgpu.slurm import SlurmTransport

            options = _slurm_options(args)
            options["ssh_command"] = options["ssh_command"] or config.ssh_command
            tunnel: Any = SlurmTransport(
                server, timeout=args.timeout, config=config, on_state=say, **options
            )
        else:
            from rgpu.ssh import SshTunnel

            options = _ssh_options(args)
            options["ssh_command"] = options["ssh_command"] or config.ssh_command
            tunnel = SshTunnel(server, token=token, timeout=args.timeout, **options)
        tunnel.start()
    except RgpuError as e:  # ConnectError, or a bad RGPU_* setting
        print(f"rgpu-run: {e}", file=sys.stderr)
        return 255
    except KeyboardInterrupt:
        return 130
    done = threading.Event()
    try:
        env["RGPU_SERVER"] = tunnel.url
        if tunnel.token:
            env["RGPU_TOKEN"] = tunnel.token
        else:
            env.pop("RGPU_TOKEN", None)
        say(tunnel.describe())
        threading.Thread(target=_keep_open, args=(tunnel, done), daemon=True).start()
        return _run(command, env)
    finally:
        done.set()
        tunnel.stop()


if __name__ == "__main__":
    sys.exit(main())
