"""The directories sessions may read and write (`--data-dir`), and what a client's path may name.

A client names a file by a path relative to a root: ``"gpt2/model.safetensors"`` (the default
root, the first one given) or ``"ckpt:run1/step100.pt"`` (the root named ckpt). Absolute paths,
`..`, symbolic links that lead out of their root, and anything that is not a regular file or a
directory (devices, FIFOs, sockets) are refused with an error that says why; so is a write to a
read-only root (``DIR:ro``), or one past the server's disk limit or the session's quota. Refusals
are `FileRefused`: the request fails, the session goes on.

Written files appear atomically: they are written next to their target under a temporary name
and renamed over it, so a reader (or a tensor mapped from the old file) never sees half a file.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

FLAG_HELP = "--data-dir DIR (repeatable; NAME=DIR names a root, DIR:ro makes it read-only)"
PARTIAL_SUFFIX = ".rgpu-partial"  # a file being written: renamed over its target when complete


class FileRefused(Exception):
    """A file request the server will not carry out; the message says why and what to do."""


@dataclass(frozen=True)
class Root:
    name: str
    path: Path  # resolved
    readonly: bool


def parse_root(spec: str) -> Root:
    """``DIR``, ``NAME=DIR``, either with ``:ro``: one --data-dir flag."""
    readonly = spec.endswith(":ro")
    if readonly:
        spec = spec[:-3]
    name, eq, folder = spec.partition("=")
    if not eq:
        folder, name = spec, ""
    path = Path(os.path.expanduser(folder)).resolve()
    name = name or path.name or "data"
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"--data-dir name {name!r}: use letters, digits, '-', '_' or '.'")
    if not path.is_dir():
        raise ValueError(f"--data-dir {folder!r} is not a directory")
    return Root(name, path, readonly)


class DataRoots:
    """The server's roots, shared by all sessions, and the bytes sessions wrote through them."""

    def __init__(
        self, roots: list[Root], max_disk: int | None = None, hub: Path | None = None
    ) -> None:
        """`hub`: the Hugging Face cache on this host, readable as ``hub:ORG/NAME[/file]``."""
        names = [r.name for r in roots]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(
                f"two --data-dir roots are named {sorted(dup)[0]!r}; name them NAME=DIR"
            )
        self.roots = {r.name: r for r in roots}
        self.default = roots[0] if roots else None
        self.max_disk = max_disk
        self.hub = hub.resolve() if hub is not None and hub.is_dir() else None
        self.written = 0  # bytes written by all sessions since the server started
        self._lock = threading.Lock()

    def describe(self) -> list[dict]:
        found = [
            {
                "name": r.name,
                "path": str(r.path),
                "readonly": r.readonly,
                "default": r is self.default,
            }
            for r in self.roots.values()
        ]
        if self.hub is not None and "hub" not in self.roots:
            found.append({"name": "hub", "path": str(self.hub), "readonly": True, "default": False})
        return found

    # -- paths ------------------------------------------------------------------------------------

    def resolve(self, path: str, *, write: bool = False) -> tuple[Root, Path]:
        """(root, absolute path) for a client's path, or FileRefused saying why not. The path
        need not exist; whatever of it exists must stay inside the root."""
        if type(path) is str and path.startswith("hub:") and "hub" not in self.roots:
            return self._hub(path[4:], write)
        if self.default is None:
            raise FileRefused(
                f"this rgpu server has no data directory, so it reads and writes no files: start "
                f"it with {FLAG_HELP}"
            )
        if type(path) is not str or not path or "\0" in path:
            raise FileRefused(f"{path!r} is not a file path")
        root = self.default
        head, colon, rest = path.partition(":")
        if colon and "/" not in head and head in self.roots:
            root, path = self.roots[head], rest
        elif colon and "/" not in head and not os.path.isabs(path):
            raise FileRefused(
                f"no data directory named {head!r} on this server; it has: "
                + ", ".join(self.roots) + f" (name a root as ROOT:path, or leave it off for {root.name!r})"
            )  # fmt: skip
        if os.path.isabs(path) or path.startswith("~"):
            raise FileRefused(
                f"{path!r} is absolute: paths are relative to a data directory "
                f"({', '.join(self.roots)}; the default is {self.default.name!r})"
            )
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise FileRefused(
                f"{path!r} climbs out with '..': paths stay inside their data directory"
            )
        if write and root.readonly:
            raise FileRefused(f"the data directory {root.name!r} is read-only (--data-dir ...:ro)")
        target = root.path.joinpath(*parts)
        real = Path(os.path.realpath(target))
        if real != root.path and root.path not in real.parents:
            raise FileRefused(
                f"{path!r} leads out of the data directory {root.name!r} through a symbolic link"
            )
        return root, target

    def _hub(self, path: str, write: bool) -> tuple[Root, Path]:
        """``ORG/NAME[/file]`` in the Hugging Face cache: the snapshot its main ref names."""
        if self.hub is None:
            raise FileRefused(
                "this rgpu server has no Hugging Face cache (HF_HUB_CACHE, or ~/.cache/huggingface"
                "/hub): download the model there first (huggingface-cli download ORG/NAME)"
            )
        if write:
            raise FileRefused("the Hugging Face cache (hub:) is read-only")
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if len(parts) < 2 or ".." in parts or any(p.startswith("-") for p in parts[:2]):
            raise FileRefused(f"hub:{path} does not name a model: use hub:ORG/NAME[/file]")
        repo = self.hub / f"models--{parts[0]}--{parts[1]}"
        try:
            commit = (repo / "refs" / "main").read_text().strip()
        except OSError:
            raise FileRefused(
                f"{parts[0]}/{parts[1]} is not in this server's Hugging Face cache ({self.hub}); "
                f"download it there first (huggingface-cli download {parts[0]}/{parts[1]})"
            ) from None
        if not commit.isalnum():
            raise FileRefused(f"the cache of {parts[0]}/{parts[1]} has a malformed refs/main")
        root = Root("hub", self.hub, True)
        target = repo.joinpath("snapshots", commit, *parts[2:])
        real = Path(os.path.realpath(target))
        if root.path not in real.parents:  # snapshot files link into blobs/, inside the cache
            raise FileRefused(f"hub:{path} leads out of the Hugging Face cache")
        return root, target

    def regular_file(self, path: str) -> tuple[Root, Path, os.stat_result]:
        """An existing regular file to read."""
        root, target = self.resolve(path)
        try:
            st = os.stat(target)
        except FileNotFoundError:
            raise FileRefused(f"no file {path!r} in the data directory {root.name!r}") from None
        except OSError as e:
            raise FileRefused(f"cannot read {path!r}: {e.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise FileRefused(f"{path!r} is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(
                f"{path!r} is not a regular file (a device, FIFO or socket): rgpu reads and writes "
                "regular files only"
            )
        return root, target, st

    def writable(self, path: str) -> Path:
        """Where a file for `path` may be written (its folder is made if missing)."""
        root, target = self.resolve(path, write=True)
        if target == root.path:
            raise FileRefused(f"{path!r} names the data directory itself, not a file in it")
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            st = None
        if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise FileRefused(f"cannot write {path!r}: it is {what}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FileRefused(f"cannot make the folder for {path!r}: {e.strerror}") from None
        return target

    # -- the disk limit ---------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> None:
        """Count bytes about to be written against the server's disk limit."""
        with self._lock:
            if self.max_disk is not None and self.written + nbytes > self.max_disk:
                raise FileRefused(
                    f"writing {nbytes} bytes would pass this server's disk limit of "
                    f"{self.max_disk} bytes for files sessions write (--max-disk-mb); "
                    f"{self.written} are written already. Remove files you no longer need."
                )
            self.written += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.written = max(0, self.written - nbytes)


def replace_atomically(partial: Path, target: Path) -> None:
    """Put a completely written file in place of `target` in one step."""
    os.replace(partial, target)


def partial_path(target: Path, tag: str = "") -> Path:
    return target.with_name(f".{target.name}{('.' + tag) if tag else ''}{PARTIAL_SUFFIX}")
