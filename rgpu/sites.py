"""Where each op was issued: a failure the server reports at a later wait names the line (and, in
a notebook, the cell) that queued the op, not the line that happened to wait.

Off by default (it walks a few stack frames per op); the Jupyter extension turns it on
(`rgpu.settings.op_sites`). Sites are kept run-length encoded by message number, bounded.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from array import array
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

import torch

import rgpu_protocol

LIMIT = 1 << 20  # runs kept; the oldest half goes when full
WAIT_SITES = 4096  # distinct lines whose waits are counted; later new lines are not
REPLAYS = 4096  # REPLAY messages whose ops' sites are kept
# filename -> how to name it; the Jupyter extension names a cell's code "cell [7]"
name_file: Callable[[str], str | None] | None = None
_LIBRARY_DIRS = tuple(
    {
        os.path.dirname(torch.__file__) + os.sep,
        os.path.dirname(os.path.abspath(__file__)) + os.sep,
        os.path.dirname(rgpu_protocol.__file__) + os.sep,
        *(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "purelib", "platlib")),
    }
)


def in_library(filename: str) -> bool:
    """A file of torch, rgpu, the standard library or an installed package (not the user's)."""
    return filename.startswith(_LIBRARY_DIRS) or filename.startswith("<frozen")


class OpSites:
    def __init__(self) -> None:
        self._seqs = array("q")  # the first message of each run
        self._sites = array("l")  # ...and where that run was issued (an index into _table)
        self._table: list[tuple[str, int]] = []
        self._index: dict[tuple[str, int], int] = {}
        self._library: dict = {}  # code object -> inside torch, rgpu or the standard library
        # (filename, line) -> waits issued there: what a per-cell advisor names ("62 waits from
        # loss.item() at cell [7], line 4")
        self.waits: dict[tuple[str, int], int] = {}
        self._replays: dict[int, list] = {}  # REPLAY seq -> the site of each op it carries

    def _user_frame(self, depth: int) -> Any:
        """The innermost frame outside the libraries, `depth` frames above the caller's caller."""
        f = sys._getframe(depth + 1)
        library = self._library
        while f is not None:
            code = f.f_code
            inside = library.get(code)
            if inside is None:
                inside = library[code] = in_library(code.co_filename)
            if not inside:
                break
            f = f.f_back
        return f

    def note_wait(self, depth: int = 2) -> None:
        """A wait is starting: count it for the user's line that caused it."""
        f = self._user_frame(depth)
        if f is None:
            return
        key = (f.f_code.co_filename, f.f_lineno)
        waits = self.waits
        if key in waits:
            waits[key] += 1
        elif len(waits) < WAIT_SITES:
            waits[key] = 1

    def here(self, depth: int = 2) -> tuple[str, int] | None:
        """(filename, line) of the innermost frame outside the libraries."""
        f = self._user_frame(depth)
        return None if f is None else (f.f_code.co_filename, f.f_lineno)

    def note(self, seq: int, depth: int = 2, keys: list | None = None) -> None:
        """Message `seq` is being queued: remember the innermost frame outside the libraries.
        For a REPLAY, `keys` are the sites of its ops, in order (`here()` when each was held):
        a failure the server reports with an op's index names that op's line."""
        if keys is not None:
            self._replays[seq] = keys
            if len(self._replays) > REPLAYS:
                del self._replays[next(iter(self._replays))]
            if keys and keys[0] is not None:
                self._add(seq, keys[0])
            return
        f = self._user_frame(depth)
        if f is None:
            return
        self._add(seq, (f.f_code.co_filename, f.f_lineno))

    def _add(self, seq: int, key: tuple[str, int]) -> None:
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = len(self._table)
            self._table.append(key)
        if self._sites and self._sites[-1] == i:
            return
        self._seqs.append(seq)
        self._sites.append(i)
        if len(self._seqs) > LIMIT:
            del self._seqs[: LIMIT // 2]
            del self._sites[: LIMIT // 2]

    def site(self, seq: int | None, index: int | None = None) -> str | None:
        """Where message `seq` (op `index` of a REPLAY) was queued, as words: "cell [7], line 4"
        or "train.py, line 30"."""
        if seq is None or not self._seqs:
            return None
        keys = self._replays.get(seq) if index is not None else None
        if keys and 0 <= index < len(keys) and keys[index] is not None:
            return describe(keys[index])
        k = bisect_right(self._seqs, seq) - 1
        if k < 0:
            return None
        return describe(self._table[self._sites[k]])


def describe(key: tuple[str, int]) -> str:
    """A (filename, line) as words: "cell [7], line 4" or "train.py, line 30"."""
    filename, line = key
    named = name_file(filename) if name_file is not None else None
    return f"{named or os.path.basename(filename)}, line {line}"
