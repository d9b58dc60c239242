"""`rgpu-server` / `python -m rgpu_server`: serve this host's GPU (or CPU) to rgpu clients.

Every setting comes from here: flags, and the environment variables that are their defaults
(RGPU_TOKEN, RGPU_COMPILE_CACHE_DIR; Hugging Face's HF_HUB_CACHE / HF_HOME for hub: paths) or
developer aids (RGPU_SERVER_PROFILE: a cProfile dump per session into that directory). Nothing
else in the server reads the environment.
"""

from __future__ import annotations

import os

# Before torch loads (rgpu_protocol imports it): OpenMP's worker threads sleep between parallel
# regions instead of spinning. The server runs ops one by one between messages, so after each
# parallel kernel the spinning threads would hold every core for a while, taking it from the
# server's own event loop and session threads, and from a client on the same machine (the
# embedded server, a CPU server beside the notebook). OMP_WAIT_POLICY=ACTIVE keeps spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import ipaddress
import logging
import secrets
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

from rgpu_protocol import DEFAULT_LIMITS

from . import __version__, idle
from .app import LOOPBACK, RgpuServer, ServerConfig
from .datadirs import DataRoots, parse_root
from .multidevice import pick_devices


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rgpu-server",
        description="Serve this host's GPU to rgpu clients over a websocket.",
        epilog="Clients authenticate with a token: --token, RGPU_TOKEN, or a random one printed at "
        "start-up as a ready-to-paste URL.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=9720,
        help="port to listen on; 0 picks a free one (default 9720)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda (every visible GPU, as rgpu:0..N-1), cuda:N or mps (default: cuda when "
        "available, else cpu)",
    )
    p.add_argument(
        "--devices",
        default=None,
        metavar="LIST",
        help="the devices to serve, in rgpu index order, e.g. cuda:0,cuda:2 (instead of --device)",
    )
    p.add_argument(
        "--virtual-devices",
        type=int,
        default=None,
        metavar="N",
        help="with --device cpu: serve N rgpu devices that all compute on the CPU (tests, demos, "
        "DistributedDataParallel with gloo)",
    )
    p.add_argument(
        "--threads",
        type=_threads,
        default=None,
        metavar="N",
        help="threads each CPU kernel may use (PyTorch's intra-op threads; default: one per core "
        "this process may run on). A CPU server on the client's machine runs faster with a core "
        "left to the client; the embedded server leaves one",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default INFO)",
    )
    auth = p.add_argument_group("security")
    auth.add_argument(
        "--token",
        action="append",
        default=None,
        help="the token clients must send (default: RGPU_TOKEN, else a random one); give it "
        "again for more users: each token sees and re-opens only its own named sessions",
    )
    auth.add_argument(
        "--token-file",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="write the token to FILE (mode 0600; default ~/.config/rgpu/token-PORT) instead of "
        "printing it, for clients that reach this host over SSH (rgpu.connect('ssh://host'))",
    )
    auth.add_argument(
        "--no-token",
        action="store_true",
        help="accept clients without a token (only on a loopback address)",
    )
    auth.add_argument(
        "--certfile", default=None, help="TLS certificate (PEM): serve wss:// instead of ws://"
    )
    auth.add_argument("--keyfile", default=None, help="TLS private key (PEM) for --certfile")
    files = p.add_argument_group("files")
    files.add_argument(
        "--data-dir",
        action="append",
        default=[],
        metavar="[NAME=]DIR[:ro]",
        help="a directory sessions may read and write files in (rgpu.files, rgpu.hf); repeatable. "
        "NAME=DIR names the root (else the folder's name), :ro makes it read-only; the first "
        "one is the default root. Without one, file calls are refused",
    )
    files.add_argument(
        "--max-disk-mb",
        type=int,
        default=None,
        help="bytes of files all sessions together may write, in MiB (default: no limit)",
    )
    named = p.add_argument_group("named sessions (rgpu.connect(url, session=NAME))")
    named.add_argument(
        "--detached-ttl",
        type=float,
        default=86400.0,
        help="seconds a named session outlives its client, with what it keeps (default 86400: "
        "a day, so a notebook left overnight finds its GPU state in the morning)",
    )
    named.add_argument(
        "--max-detached-mb",
        type=int,
        default=None,
        help="tensor memory all detached named sessions may hold together, in MiB; past it, the "
        "longest-detached are freed, and a keep that would pass it is refused (default: no limit)",
    )
    named.add_argument(
        "--state-dir",
        default=None,
        help="where rgpu.keep(..., durable=True) writes kept objects, so they survive a server "
        "restart (default: none; durable keeps are refused)",
    )
    lim = p.add_argument_group("limits")
    p.add_argument(
        "--compile-cache-dir",
        default=os.environ.get("RGPU_COMPILE_CACHE_DIR") or None,
        help="where compiled graphs are cached across sessions and restarts (default: "
        "RGPU_COMPILE_CACHE_DIR, else ~/.cache/rgpu)",
    )
    p.add_argument(
        "--preload-inductor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="import Inductor and compile a tiny graph before taking clients (2-4 s; longer the "
        "first time on a new cache), so the first client's compiled graph starts seconds "
        "sooner (default: on)",
    )
    lim.add_argument(
        "--session-grace",
        type=float,
        default=120.0,
        help="seconds a session waits for its client to reconnect (default 120)",
    )
    lim.add_argument(
        "--max-sessions", type=int, default=64, help="sessions served at once (default 64)"
    )
    lim.add_argument(
        "--session-quota-mb",
        type=int,
        default=None,
        help="tensor memory one session may hold, in MiB (default: no limit)",
    )
    lim.add_argument(
        "--max-message-mb",
        type=int,
        default=DEFAULT_LIMITS.max_message >> 20,
        help="largest websocket message accepted, in MiB (default %(default)s)",
    )
    lim.add_argument(
        "--idle-exit",
        type=float,
        default=None,
        metavar="S",
        help="stop when no client has used the server for S seconds, or (if sooner) when none "
        f"has connected {idle.FIRST_CLIENT_S:.0f} s after start: for a server that holds a batch "
        "job's GPU (default: never)",
    )
    p.add_argument("--version", action="version", version=f"rgpu-server {__version__}")
    # for the embedded server a client starts: read the token from stdin, print the URL on stdout,
    # exit when stdin closes
    p.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--token-stdin", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--exit-with-stdin", action="store_true", help=argparse.SUPPRESS)
    return p


def _threads(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of threads: give 1 or more")
    return value


def _hub_cache() -> Path:
    """Where Hugging Face keeps downloaded models on this host (its own variables decide)."""
    explicit = os.environ.get("HF_HUB_CACHE")
    if explicit:
        return Path(explicit)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def write_token_file(path: str, token: str) -> None:
    """Write the token readable by this user only: a fresh file (no symlink followed) replaces
    the old one atomically, so no reader ever sees a partial or wider-moded token."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # websockets logs every connection at INFO; our own session lines say it better
    logging.getLogger("websockets").setLevel(
        logging.DEBUG if args.log_level == "DEBUG" else logging.WARNING
    )
    log = logging.getLogger("rgpu_server")
    if bool(args.certfile) != bool(args.keyfile):
        print("rgpu-server: --certfile and --keyfile go together", file=sys.stderr)
        return 2
    if args.no_token:
        if not _is_loopback(args.host):
            print(
                f"rgpu-server: refusing to listen on {args.host} without a token: anyone who can reach "
                "the port could run code on the GPU and read its memory. Drop --no-token, or listen on "
                "127.0.0.1 and reach it through an SSH tunnel.",
                file=sys.stderr,
            )
            return 2
        token = None
    elif args.token_stdin:
        token = sys.stdin.readline().strip() or None
        if not args.exit_with_stdin:  # stdin was the token's file: keep no way back to it
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
    else:
        token = (args.token or [None])[0] or os.environ.get("RGPU_TOKEN") or None
    generated = token is None and not args.no_token
    if generated:
        token = secrets.token_urlsafe(32)
    from .graphs import configure_cache, preload_inductor

    configure_cache(args.compile_cache_dir)  # before anything imports Inductor
    try:
        roots = [parse_root(spec) for spec in args.data_dir]
        data = DataRoots(
            roots,
            None if args.max_disk_mb is None else args.max_disk_mb << 20,
            hub=_hub_cache(),
        )
    except ValueError as e:
        print(f"rgpu-server: {e}", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    devices = pick_devices(args.device, args.devices, args.virtual_devices)
    device = devices[0]
    if args.preload_inductor:
        preload_inductor(device)
    limits = replace(DEFAULT_LIMITS, max_message=max(args.max_message_mb, 1) << 20)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        device=device,
        devices=tuple(devices),
        limits=limits,
        token=token,
        certfile=args.certfile,
        keyfile=args.keyfile,
        grace=args.session_grace,
        max_sessions=args.max_sessions,
        quota=None if args.session_quota_mb is None else args.session_quota_mb << 20,
        profile_dir=os.environ.get("RGPU_SERVER_PROFILE") or None,
        data=data,
        tokens=tuple(args.token[1:]) if args.token and token is not None else (),
        detached_ttl=args.detached_ttl,
        max_detached=None if args.max_detached_mb is None else args.max_detached_mb << 20,
        state_dir=args.state_dir,
    )
    server = RgpuServer(config)

    def on_ready(srv: RgpuServer) -> None:
        if args.token_file is not None and token is not None:
            port = srv.url.rsplit(":", 1)[1]
            path = args.token_file or os.path.expanduser(f"~/.config/rgpu/token-{port}")
            write_token_file(path, token)
            print(f"rgpu-server: the token is in {path}", file=sys.stderr, flush=True)
        elif generated:  # printed, not logged: it must show at any --log-level
            print(
                f'rgpu-server: clients connect with:  rgpu.connect("{srv.url}/?token={token}")',
                file=sys.stderr,
                flush=True,
            )
        elif token is None:
            log.warning("no token: any process that can reach %s can use this GPU", srv.url)
        if args.announce:
            print(f"RGPU_SERVER={srv.url}", flush=True)
        if args.idle_exit:
            idle.watch(srv, args.idle_exit)

    if args.exit_with_stdin:

        def watch_stdin() -> None:
            try:
                while sys.stdin.buffer.read(4096):
                    pass
            except (OSError, ValueError):
                pass
            server.stop()

        threading.Thread(target=watch_stdin, daemon=True, name="rgpu-stdin-watch").start()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, server.stop)
            except (NotImplementedError, RuntimeError):
                pass
        await server.run(on_ready)

    try:
        asyncio.run(run())
    except OSError as e:
        print(
            f"rgpu-server: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
