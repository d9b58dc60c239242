"""Where the one live widget is shown: in the cell that asked for it, or in JupyterLab's side panel.

A kernel has one `RgpuWidget`. Each showing wraps it in a new `Frame` (a box holding it) in the
cell's output; the frames shown before are emptied down to a one-line note pointing to the new
place, so however often `%rgpu connect` or `%rgpu widget` runs, one live copy is on the page, in
the newest place. The side panel is a `sidecar.Sidecar` (the ipywidgets side-panel package for
JupyterLab, `pip install sidecar`): the widget stays in view while the notebook scrolls.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
from IPython.display import display

from .render import CSS

SIDECAR_MISSING = (
    "rgpu: the side panel needs the sidecar package (pip install sidecar, then reload "
    "JupyterLab's page); showing the widget here instead"
)


class Frame(widgets.VBox):
    """One place the widget was shown; its text repr is the widget's (notebooks compare it)."""

    def __init__(self, widget: Any) -> None:
        super().__init__(children=[widget])
        self.add_class("rgpu-frame")
        self._widget = widget

    def __repr__(self) -> str:
        return repr(self._widget)


class Placement:
    """Shows the one widget in its newest place and empties the older ones."""

    def __init__(self, widget: Any) -> None:
        self.widget = widget
        self.frames: list[Frame] = []
        self.sidecar: Any = None
        self._note: widgets.HTML | None = None

    @property
    def in_side_panel(self) -> bool:
        return self.sidecar is not None and self.sidecar.comm is not None

    def show_inline(self) -> Frame:
        """Display the widget in the running cell's output (the older places keep a note)."""
        frame = self._new_frame("the live view moved to a later cell")
        if self.sidecar is not None:  # out of the side panel, into this cell
            self.sidecar.close()
            self.sidecar = None
        display(frame)
        return frame

    def show_side(self, title: str = "rgpu") -> bool:
        """Put the widget in JupyterLab's side panel; False (and a message) without sidecar."""
        try:
            from sidecar import Sidecar
        except ImportError:
            print(SIDECAR_MISSING)
            self.show_inline()
            return False
        if self.sidecar is not None:
            self.sidecar.close()  # a panel the user may have closed: open a fresh one
        self.sidecar = Sidecar(title=title)
        frame = self._new_frame("the live view is in the side panel")
        with self.sidecar:
            display(frame)
        print("rgpu: the live widget is in JupyterLab's side panel (right)")
        return True

    def _new_frame(self, why: str) -> Frame:
        note = self._note_widget(why)
        for old in self.frames:
            old.children = (note,)
        self.frames = [Frame(self.widget)]
        return self.frames[0]

    def _note_widget(self, why: str) -> widgets.HTML:
        if self._note is None:
            self._note = widgets.HTML()
        self._note.value = f'{CSS}<span class="rgpu-w rgpu-dim rgpu-moved">rgpu: {why}</span>'
        return self._note

    def close(self) -> None:
        for frame in self.frames:
            frame.close()
        self.frames = []
        if self._note is not None:
            self._note.close()
            self._note = None
        if self.sidecar is not None:
            self.sidecar.close()
            self.sidecar = None
