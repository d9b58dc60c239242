"""IPython extension for rgpu: the `%rgpu` magic and a live per-cell stats widget.

    %load_ext rgpu_jupyter
    %rgpu connect            # $RGPU_SERVER, or an embedded local server
    %rgpu connect local      # always the embedded local server

See `%rgpu?` for the commands. Loading registers the magics and two IPython event hooks
(`pre_run_cell`, `post_run_cell`) that record what each cell costs; `%unload_ext` and
`%reload_ext` remove them, so hooks are never registered twice.
"""

from __future__ import annotations

import inspect
from typing import Any

from .accounting import CellAccounting, CellCost
from .magics import RgpuMagics
from .report import CellStats, cell_line, format_bytes

__all__ = [
    "load_ipython_extension",
    "unload_ipython_extension",
    "RgpuMagics",
    "CellAccounting",
    "CellCost",
    "CellStats",
    "cell_line",
    "format_bytes",
]

_ATTR = "_rgpu_jupyter_magics"  # where the loaded instance lives on the shell


def load_ipython_extension(ip: Any) -> None:
    """Register `%rgpu` / `%%rgpu`, the settings, and the per-cell accounting hooks."""
    previous = getattr(ip, _ATTR, None)
    if previous is not None:  # loaded again without an unload (e.g. after importlib.reload)
        unload_ipython_extension(ip)
    magics = RgpuMagics(shell=ip)
    ip.register_magics(magics)  # also makes it a configurable, for %config RgpuMagics...
    if magics not in ip.configurables:
        ip.configurables.append(magics)
    magics.accounting.register(ip)
    magics.accounting.begin_now()  # the cell running %load_ext counts from here
    if not _ipython_shows_notes():
        _unregister_notes(ip)
        ip.events.register("post_run_cell", show_rgpu_notes)
    setattr(ip, _ATTR, magics)


def unload_ipython_extension(ip: Any) -> None:
    """Remove the hooks, the magics and the widget, so a later load starts clean."""
    magics = getattr(ip, _ATTR, None)
    if magics is None:
        return
    magics.accounting.unregister()
    _unregister_notes(ip)
    magics.close()
    for kind in ("line", "cell"):
        table = ip.magics_manager.magics[kind]
        if getattr(table.get("rgpu"), "__self__", None) is magics:
            del table["rgpu"]
    ip.magics_manager.registry.pop(type(magics).__name__, None)
    while magics in ip.configurables:
        ip.configurables.remove(magics)
    delattr(ip, _ATTR)


def show_rgpu_notes(result: Any) -> None:
    """Print rgpu's notes on a cell's exception (PEP 678), which IPython 8's tracebacks leave out
    (checked at load): on an interrupt, the note says what became of the server's queued work.
    rgpu's own errors show theirs already (`_render_traceback_`)."""
    error = getattr(result, "error_in_exec", None)
    if error is None or hasattr(error, "_render_traceback_"):
        return
    for note in getattr(error, "__notes__", None) or ():
        if isinstance(note, str) and note.startswith("rgpu:"):
            print(note)


def _ipython_shows_notes() -> bool:
    from IPython.core import ultratb

    try:
        return "__notes__" in inspect.getsource(ultratb)
    except (OSError, TypeError):
        return False


def _unregister_notes(ip: Any) -> None:
    for cb in list(ip.events.callbacks.get("post_run_cell", [])):
        if getattr(cb, "__name__", "") == "show_rgpu_notes":
            ip.events.unregister("post_run_cell", cb)
