"""The `%rgpu` line magic and `%%rgpu` cell magic.

Settings are traitlets, so `%config RgpuMagics.widget = False` (or `ipython_config.py`) works.
Every user mistake (bad arguments, no connection, an unreachable server) is a one-line
`UsageError`, which notebooks show without a traceback.
"""

from __future__ import annotations

import ast
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Int, default, observe, validate
from traitlets.config import Configurable

import rgpu
import rgpu.sites
from rgpu.errors import hint

from .accounting import CellAccounting, make_cost, send_leftovers
from .advice import advise
from .render import memory_text, time_split, utilization_text
from .report import CellStats, cell_line, format_bytes, format_seconds, plural
from .usage import check_targets, checked, client_torch, device_lines, format_left


@magics_class
class RgpuMagics(Magics, Configurable):
    """Connect to an rgpu server and see what each cell costs it."""

    widget = Bool(True, help="Show the live stats widget after %rgpu connect.").tag(config=True)
    widget_side = Bool(
        False,
        help="Show the widget in JupyterLab's side panel, where it stays in view (needs the "
        "sidecar package), not in the cell's output.",
    ).tag(config=True)
    widget_compact = Bool(False, help="Show the widget as one line.").tag(config=True)
    stats_interval = Float(0.2, help="Seconds between widget refreshes (at least 0.1).").tag(
        config=True
    )
    history = Int(20, help="How many recent cells %rgpu stats and the widget remember.").tag(
        config=True
    )
    widget_rows = Int(8, help="How many recent cells the widget's chart shows.").tag(config=True)
    progress_mb = Float(
        help="Transfers of at least this many MiB show a progress bar (0 turns bars off)."
    ).tag(config=True)
    op_sites = Bool(
        True,
        help="Record the cell and line that queued each op, so a failure the server reports at "
        "a later wait names them (a few stack frames per op).",
    ).tag(config=True)

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        Configurable.__init__(self, config=shell.config if shell is not None else None, **kwargs)
        Magics.__init__(self, shell=shell)
        self.accounting = CellAccounting(keep=self.history)
        self._widget: Any = None
        self._placement: Any = None
        rgpu.settings.op_sites = self.op_sites
        rgpu.sites.name_file = self._cell_of

    def _cell_of(self, filename: str) -> str | None:
        """A cell's code, as IPython compiled it, named as the user sees it: "cell [7]"."""
        number = getattr(getattr(self.shell, "compile", None), "_filename_map", {}).get(filename)
        return f"cell [{number}]" if number is not None else None

    @observe("op_sites")
    def _op_sites_changed(self, change: dict) -> None:
        rgpu.settings.op_sites = change["new"]

    @default("progress_mb")
    def _progress_mb_default(self) -> float:
        return rgpu.settings.progress_bytes / (1 << 20)

    @observe("progress_mb")
    def _progress_mb_changed(self, change: dict) -> None:
        rgpu.settings.progress_bytes = int(change["new"] * (1 << 20))

    @validate("stats_interval")
    def _valid_interval(self, proposal: dict) -> float:
        return max(0.1, float(proposal["value"]))  # the widget refreshes at most 10 times a second

    @observe("history")
    def _history_changed(self, change: dict) -> None:
        if hasattr(self, "accounting"):
            self.accounting.keep = change["new"]

    @observe("stats_interval", "widget_rows")
    def _widget_settings_changed(self, change: dict) -> None:
        w = getattr(self, "_widget", None)
        if w is not None:  # the running widget follows the new setting at its next refresh
            w.interval = self.stats_interval
            w.rows = self.widget_rows

    # -- the magic ---------------------------------------------------------------------------

    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        choices=["connect", "disconnect", "status", "stats", "widget", "ls", "sessions", "drop"],
        help="what to do (see above)",
    )
    @argument(
        "target",
        nargs="*",
        default=None,
        help="for connect: ws://HOST:PORT, HOST:PORT, ssh://USER@HOST, slurm://USER@LOGIN or "
        "local (several: one device list); for ls: a folder; for drop: a session name",
    )
    @argument(
        "--token", default=None, help="for connect: the server's token (default: $RGPU_TOKEN)"
    )
    @argument("--session", default=None, help="for connect: open (or re-open) a named session")
    @argument("--takeover", action="store_true", help="for connect: take the named session over")
    @argument(
        "-o", "--object", action="store_true", help="for stats: return the table as an object"
    )
    @argument("--clear", action="store_true", help="for stats: forget the recorded cells")
    @argument("--side", action="store_true", help="for widget: in JupyterLab's side panel")
    @argument("--inline", action="store_true", help="for widget: in this cell's output")
    @argument("--compact", action="store_true", help="for widget: one line")
    @argument("--full", action="store_true", help="for widget: the full view")
    @line_cell_magic
    def rgpu(self, line: str, cell: str | None = None) -> Any:
        """Use a remote GPU from this notebook, and see what each cell costs it.

        %rgpu connect [URL | local] [--token T]
            Connect (same rules as rgpu.connect: several URLs make one device list, the first
            server's devices numbered first; no URL means $RGPU_SERVER, else an embedded
            local server; ssh://user@host tunnels over SSH, starting a server there if none
            runs; slurm://user@login?partition=gpu&gres=gpu:1&time=2:00:00 runs the server as a
            Slurm job, printing its state while it waits (interrupt the kernel to cancel it))
            and print the server, its device and the round-trip time; then show the live
            widget (unless %config RgpuMagics.widget = False).
        %rgpu disconnect
            End the session; its tensors are freed on the server.
        %rgpu status
            Server URL, devices, server and client versions, session id, tensors and bytes this
            session holds on the server, and the round-trip time measured now.
        %rgpu stats [-o] [--clear]
            A table of recent cells: messages, waits, bytes out/in, time spent waiting, wall
            time. -o returns it as an object (text and HTML reprs; .as_dicts() for pandas).
        %rgpu widget [--side | --inline] [--compact | --full]
            Show the live widget here (it moves: a kernel has one), or in JupyterLab's side
            panel with --side, where it stays in view (pip install sidecar); --compact shows
            one line. Defaults: %config RgpuMagics.widget_side / .widget_compact.
        %rgpu connect URL --session NAME [--takeover]
            Open (or re-open, after a kernel restart) a named session: it stays on the server
            when this kernel goes (--detached-ttl), and rgpu.kept(NAME) finds what
            rgpu.keep(NAME, obj) marked in it. --takeover takes it from a client holding it.
        %rgpu sessions
            This token's sessions on the server: live or detached, memory, what they keep.
        %rgpu drop NAME
            End a named session now (its tensors and kept objects are freed).
        %rgpu ls [PATH]
            The files in a folder on the server (its --data-dir roots: "" is the default root,
            "ROOT:" another, "hub:ORG/NAME" a model in its Hugging Face cache), with sizes.

        %%rgpu
            As the first line of a cell: run the cell, then print what it cost in one line,
            e.g. "rgpu: 104 messages, 1 wait, 3.3 KiB out, 12 B in". A message is one op or
            request sent to the server; a wait is one point where Python blocked for its answer
            (waits x round-trip time is the latency bill).

        Settings: %config RgpuMagics.widget, .widget_side, .widget_compact, .stats_interval,
        .history, .widget_rows, .progress_mb (progress bars for transfers at least this big).
        """
        if cell is not None:
            if line.strip():
                raise UsageError("%%rgpu takes no arguments; use %rgpu ACTION on a line of its own")
            return self._run_counted(cell)
        args = checked(parse_argstring(self.rgpu, line))
        return getattr(self, "_do_" + args.action)(args)

    # -- actions -----------------------------------------------------------------------------

    def _do_connect(self, args: Any) -> None:
        check_targets(args.targets)
        try:
            session = rgpu.connect(
                args.targets if len(args.targets) > 1 else args.target,
                token=args.token,
                session=args.session,
                takeover=args.takeover,
            )
            rtt = session.ping()
        except rgpu.RgpuError as e:
            raise UsageError(f"rgpu: {hint(str(e))}") from None
        devices = rgpu.device_list()
        if len(devices) <= 1:
            print(
                f"rgpu: connected to {session.url}, {session.device} ({session.device_name}), "
                f"RTT {format_seconds(rtt)}"
            )
        else:
            servers = len({d["server"] for d in devices})
            print(
                f"rgpu: connected to {plural(servers, 'server')} ({len(devices)} devices), RTT "
                f"{format_seconds(rtt)} to {session.url}"
            )
            print(device_lines(devices))
        if session.name is not None:
            kept = session.kept_names if session.welcome.attached else ()
            print(
                f"rgpu: session {session.name!r} "
                + (
                    f"re-opened; it keeps: {', '.join(kept)}"
                    if kept
                    else "(named: it outlives this kernel)"
                )
            )
        if self._widget is not None:
            self._widget.rtt = rtt
        if self.widget and self._frontend_shows_widgets():
            self._show_widget(rtt, args, moving=False)

    def _do_disconnect(self, args: Any) -> None:
        session = self._session()
        url = session.url
        rgpu.disconnect()
        print(f"rgpu: disconnected from {url}")

    def _do_status(self, args: Any) -> None:
        session = self._session()
        lines = [
            (
                "server",
                f"{session.url} (rgpu-server {session.server_version}, torch {session.server_torch})",
            ),
            ("device", f"{session.device} ({session.device_name})")
            if len(rgpu.device_list()) <= 1
            else ("devices", "\n" + device_lines(rgpu.device_list())),
            ("client", f"rgpu {rgpu.__version__}, torch {client_torch()}"),
            ("session", session.session_id),
            ("state", session.state),
        ]
        if session.state == "connected":
            try:
                info = session.info()
                rtt = session.ping()
            except rgpu.ConnectionLost as e:
                lines.append(("held", f"unknown: {e}"))
            except rgpu.RemoteError as e:  # the server reports a pending failure to any wait
                lines.append(("error", f"{e} (reported here; later waits will not raise it)"))
            else:
                held = f"{plural(info['tensors'], 'tensor')}, {format_bytes(info['bytes'])}"
                lines.append(("held", held + " on the server"))
                memory = memory_text(info)
                if memory is not None:
                    lines.append(("memory", memory))
                lines.append(("use", utilization_text(info)))
                lines.append(("RTT", format_seconds(rtt)))
                if self._widget is not None:
                    self._widget.rtt = rtt
                    self._widget.facts = info
        last = self.accounting.recent(1)
        if last:
            lines.append((f"cell [{last[0].number}]", time_split(last[0])))
            advice = advise(last[0], getattr(self._widget, "rtt", None))
            if advice:
                lines.append(("advice", advice))
        width = max(len(k) for k, _ in lines)
        print("\n".join(f"{k.ljust(width)}  {v}" for k, v in lines))

    def _do_stats(self, args: Any) -> CellStats | None:
        table = CellStats(self.accounting.recent())
        if args.clear:
            self.accounting.clear()
        if args.object:
            return table
        print(repr(table))
        return None

    def _do_sessions(self, args: Any) -> None:
        self._session()
        try:
            entries = rgpu.sessions()
        except rgpu.RgpuError as e:
            raise UsageError(f"rgpu: {hint(str(e))}") from None
        several = len({e.server for e in entries}) > 1
        for e in entries:
            left = "" if e.seconds_left is None else f", {format_left(e.seconds_left)} left"
            mark = "* " if e.current else "  "
            where = f" on {e.server}" if several else ""
            print(
                f"{mark}{e.name or '(unnamed ' + e.session + ')'}{where}: {e.state} since "
                f"{e.since}, {plural(e.tensors, 'tensor')}, {format_bytes(e.bytes)}, "
                f"kept: {', '.join(e.kept) or 'nothing'}{left}"
            )

    def _do_drop(self, args: Any) -> None:
        self._session()
        try:
            rgpu.drop_session(args.target)
        except rgpu.RgpuError as e:
            raise UsageError(f"rgpu: {hint(str(e))}") from None
        print(f"rgpu: dropped the session {args.target!r}")

    def _do_ls(self, args: Any) -> None:
        import rgpu.files

        self._session()
        folder = args.target or ""
        try:
            entries = rgpu.files.scandir(folder)
        except rgpu.RgpuError as e:
            raise UsageError(f"rgpu: {hint(str(e))}") from None
        if not entries:
            print(f"rgpu: {folder or 'the default root'} is empty")
            return
        width = max(len(format_bytes(st.size)) for _, st in entries)
        for name, st in entries:
            size = "-" if st.is_dir else format_bytes(st.size)
            print(f"{size.rjust(width)}  {name}{'/' if st.is_dir else ''}")

    def _do_widget(self, args: Any) -> None:
        if not self._frontend_shows_widgets():
            raise UsageError(
                "rgpu: the widget needs a Jupyter frontend; in a terminal use %rgpu stats"
            )
        self._show_widget(None, args, moving=True)

    # -- helpers -----------------------------------------------------------------------------

    def _session(self) -> Any:
        session = rgpu.current_session()
        if session is None or session.state == "closed":
            raise UsageError("rgpu: not connected; run %rgpu connect [URL | local] first")
        return session

    def _frontend_shows_widgets(self) -> bool:
        """A Jupyter kernel can show widgets; a terminal IPython cannot."""
        return getattr(self.shell, "kernel", None) is not None

    def _show_widget(self, rtt: float | None, args: Any, moving: bool) -> Any:
        """Show the kernel's one widget: in this cell (the older places keep a note), or in the
        side panel. `%rgpu connect` (not `moving`) leaves a widget already in the side panel
        there."""
        try:
            from .placement import Placement
            from .widget import RgpuWidget
        except ImportError as e:
            raise UsageError(
                f"rgpu: the widget needs ipywidgets ({e}); pip install 'jupyter-rgpu[jupyter]'"
            ) from None
        w = self._widget
        if w is None or w.comm is None:
            if self._placement is not None:
                self._placement.close()
            w = self._widget = RgpuWidget(
                self.accounting, interval=self.stats_interval, rows=self.widget_rows
            )
            self._placement = Placement(w)
            w.compact = self.widget_compact
        if rtt is not None:
            w.rtt = rtt
        if args.compact or args.full:
            w.compact = args.compact
        w.refresh()
        placement = self._placement
        if placement.in_side_panel and not (moving or args.side or args.inline):
            return w  # reconnected: the widget in the side panel stays where it is
        if (self.widget_side or args.side) and not args.inline:
            placement.show_side()
        else:
            placement.show_inline()
        return w

    def _run_counted(self, cell: str) -> Any:
        """Run a cell like %%time does, then print its one-line cost, also when it raises."""
        shell = self.shell
        # a blank first line where %%rgpu was: line numbers (op sites, advice) match the cell's
        source = "\n" + shell.transform_cell(cell)
        tree = shell.transform_ast(shell.compile.ast_parse(source))
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        running = self.accounting._running  # named "cell [N]" as the accounting numbers it
        number = running.number if running is not None else shell.execution_count
        filename = shell.compile.cache(source, number)
        body = shell.compile(tree, filename, "exec")
        tail = shell.compile(last, filename, "eval") if last is not None else None
        ns = shell.user_ns
        try:
            send_leftovers()  # what earlier cells left queued is not this cell's cost
        except rgpu.RgpuError:
            pass
        start = self.accounting.snapshot()
        t0 = time.perf_counter()
        try:
            exec(body, ns)
            return eval(tail, ns) if tail is not None else None
        finally:
            end = self.accounting.snapshot()
            cost = make_cost("", "", 0, end.since(start), time.perf_counter() - t0, True)
            cost.busiest, cost.busiest_waits = end.busiest_since(start)
            print(cell_line(cost))
            advice = advise(cost, getattr(self._widget, "rtt", None))
            if advice:  # timing decides whether it shows: notebooks/sanitize.cfg drops it
                print(f"rgpu: advice: {advice}")

    def close(self) -> None:
        """Stop the widget's timer and close it, and stop recording op sites (on %unload_ext)."""
        rgpu.settings.op_sites = False
        if rgpu.sites.name_file == self._cell_of:
            rgpu.sites.name_file = None
        if self._placement is not None:
            self._placement.close()
            self._placement = None
        if self._widget is not None:
            self._widget.close()
            self._widget = None
