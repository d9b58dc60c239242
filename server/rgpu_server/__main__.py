"""`rgpu-server` / `python -m rgpu_server`: serve this host's GPU (or CPU) to rgpu clients."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading

from rgpu.protocol import DEFAULT_LIMITS

from . import __version__
from .app import RgpuServer, ServerConfig, pick_device


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rgpu-server",
        description="Serve this host's GPU to rgpu clients over a websocket.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9720, help="port to listen on; 0 picks a free one (default 9720)")
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:N or mps (default: cuda when available, else cpu)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default INFO)",
    )
    p.add_argument(
        "--max-message-mb",
        type=int,
        default=DEFAULT_LIMITS.max_message >> 20,
        help="largest websocket message accepted, in MiB (default %(default)s)",
    )
    p.add_argument("--version", action="version", version=f"rgpu-server {__version__}")
    # for the embedded server a client starts: print the URL on stdout, exit when stdin closes
    p.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--exit-with-stdin", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # websockets logs every connection at INFO; our own session lines say it better
    logging.getLogger("websockets").setLevel(logging.DEBUG if args.log_level == "DEBUG" else logging.WARNING)
    device = pick_device(args.device)
    from dataclasses import replace

    limits = replace(DEFAULT_LIMITS, max_message=max(args.max_message_mb, 1) << 20)
    server = RgpuServer(ServerConfig(host=args.host, port=args.port, device=device, limits=limits))

    def on_ready(srv: RgpuServer) -> None:
        if args.announce:
            print(f"RGPU_SERVER={srv.url}", flush=True)

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
        print(f"rgpu-server: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
