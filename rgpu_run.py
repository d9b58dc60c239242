"""`rgpu-run`: run an unmodified script against a remote GPU.

    rgpu-run --host user@gpuhost -- python train.py --epochs 3
    rgpu-run --server ws://127.0.0.1:9720 --token T -- python train.py

The child gets ``RGPU_SERVER`` (and ``RGPU_TOKEN``) in its environment; `import rgpu` there
connects on first use. With ``--host`` an SSH tunnel (and, when none runs there, an rgpu-server
on the host) lives exactly as long as the child. Exit status: the child's (128+N if a signal N
ended it, so 130 after Ctrl-C), 127 if the command was not found, 126 if it could not run, 2
for a usage error, 255 when the host or server could not be reached.

A top-level module, not part of the `rgpu` package: `rgpu-run --help` and `--server` never import
torch; only `--host` does (for the tunnel).
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
        usage="rgpu-run [--host [USER@]HOST [options] | --server URL] [--token T] -- COMMAND [ARGS...]",
        description="Run COMMAND (e.g. python train.py) with the rgpu device on a remote GPU: "
        "RGPU_SERVER and RGPU_TOKEN are set in its environment.",
        epilog="Without --host or --server, RGPU_SERVER from the environment is used (ssh:// URLs "
        "included). RGPU_SSH_COMMAND sets the ssh client and its options (default: ssh).",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--host", metavar="[USER@]HOST", help="reach the GPU host over SSH")
    where.add_argument("--server", metavar="URL", help="ws://, wss:// or ssh:// URL of a server")
    p.add_argument("--token", help="the server's token (default: RGPU_TOKEN)")
    ssh = p.add_argument_group("with --host")
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
    p.add_argument("-q", "--quiet", action="store_true", help="no line about the tunnel")
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


def _keep_open(tunnel: Any, done: threading.Event) -> None:
    """Re-open the tunnel when its ssh dies: the child reconnects to the same local port."""
    while not done.wait(0.5):
        if not tunnel.alive:
            try:
                tunnel.ensure()
            except Exception as e:  # the child's reconnect gives up in its own time
                print(f"rgpu-run: {e}", file=sys.stderr)
                if tunnel.server is not None and not tunnel.server.alive:
                    return


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
    server = args.server or (None if args.host else os.environ.get("RGPU_SERVER"))
    if args.host:
        server = "ssh://" + args.host
    elif any(v is not None for v in _ssh_options(args).values()):
        if not (server or "").lower().startswith("ssh://"):
            p.error("SSH options need --host (or an ssh:// --server)")
    if not server:
        p.error("say where the GPU is: --host [USER@]HOST or --server URL (or set RGPU_SERVER)")
    env = dict(os.environ)
    token = args.token or os.environ.get("RGPU_TOKEN")
    if not server.lower().startswith("ssh://"):
        env["RGPU_SERVER"] = server
        if args.token:
            env["RGPU_TOKEN"] = args.token
        return _run(command, env)

    from rgpu import RgpuError
    from rgpu.config import Config
    from rgpu.ssh import SshTunnel

    try:
        options = _ssh_options(args)
        options["ssh_command"] = options["ssh_command"] or Config.from_env().ssh_command
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
        if not args.quiet:
            print(f"rgpu-run: {tunnel.describe()}", file=sys.stderr, flush=True)
        threading.Thread(target=_keep_open, args=(tunnel, done), daemon=True).start()
        return _run(command, env)
    finally:
        done.set()
        tunnel.stop()


if __name__ == "__main__":
    sys.exit(main())
