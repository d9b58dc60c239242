"""What `%rgpu` accepts: its arguments checked before anything runs (a usage error loses no
session), and the plain-text pieces its actions print."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError


def checked(args: Any) -> Any:
    """The parsed arguments, with `targets` (every URL) and `target` (the first), or a
    UsageError that names what does not belong."""
    targets = args.target or []
    if len(targets) > 1 and args.action != "connect":
        raise UsageError(f"%rgpu {args.action} takes one argument, not {len(targets)}")
    args.targets = targets
    args.target = targets[0] if targets else None
    if args.action is None:
        raise UsageError(
            "%rgpu needs an action: connect, disconnect, status, stats, widget, sessions, drop "
            "or ls (see %rgpu?)"
        )
    if args.action != "connect" and (args.session is not None or args.takeover):
        raise UsageError("--session and --takeover belong to %rgpu connect")
    if args.action in ("ls", "drop") and args.token is not None:
        raise UsageError(f"%rgpu {args.action} takes no token")
    if args.action == "drop" and not args.target:
        raise UsageError("%rgpu drop needs a session name")
    if args.action not in ("connect", "ls", "drop") and (
        args.target is not None or args.token is not None
    ):
        raise UsageError(f"%rgpu {args.action} takes no URL or token")
    if args.action != "stats" and (args.object or args.clear):
        raise UsageError(f"-o and --clear belong to %rgpu stats, not %rgpu {args.action}")
    if args.action not in ("widget", "connect") and (
        args.side or args.inline or args.compact or args.full
    ):
        raise UsageError(
            f"--side, --inline, --compact and --full belong to %rgpu widget, not %rgpu {args.action}"
        )
    if (args.side and args.inline) or (args.compact and args.full):
        raise UsageError("choose one of --side / --inline and one of --compact / --full")
    return args


def check_targets(targets: list[str]) -> None:
    """Refuse what cannot be a server before connect ends the current session."""
    if len(targets) > 1:  # several servers: each must be a server, not a stray word
        stray = [t for t in targets if "://" not in t and ":" not in t and t != "local"]
        if stray:
            raise UsageError(f"unrecognized arguments: {' '.join(stray)}")
    for target in targets:
        if target and target != "local" and "://" in target:
            scheme = target.split("://", 1)[0].lower()
            if scheme not in ("ws", "wss", "ssh", "slurm"):  # refuse before connect ends
                raise UsageError(  # the session
                    f"rgpu: servers are reached over ws:// or wss:// (or ssh://, slurm://), "
                    f"not {scheme}:// ({target})"
                )


def device_lines(devices: list[dict]) -> str:
    """One line per device: rgpu index, name, and (with several servers) where and how it is."""
    servers = len({d["server"] for d in devices}) > 1
    return "\n".join(
        f"  {d['device']}  {d['name']}" + (f"  ({d['server']}, {d['state']})" if servers else "")
        for d in devices
    )


def format_left(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def client_torch() -> str:
    import torch

    return torch.__version__
