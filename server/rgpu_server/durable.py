"""Kept objects written to the server's disk (`rgpu.keep(..., durable=True)`, `--state-dir`), so
a named session's kept state survives a server restart.

Layout: ``STATE_DIR/OWNER/SESSION/KEPT/`` holds ``tree.msgpack`` (the kept object's structure,
tensors as indices), ``tensors.pt`` (its tensors, written with `torch.save` and read back with
`weights_only=True`, memory-mapped) and ``devices.msgpack`` (each tensor's device index, so it is
restored onto that device; a folder written before it existed, or an index the restarted server
no longer has, means device 0); ``STATE_DIR/OWNER/SESSION/rng.bin`` is the session's
generator state at the last durable keep. OWNER is a hash of the token, so a server started with
another token sees none of it. Writes go to a temporary folder renamed into place.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rgpu_protocol import Encoder, unpack_one
from rgpu_protocol.codec import Limits
from rgpu_protocol.handshake import valid_session_name

TREE = "tree.msgpack"
TENSORS = "tensors.pt"
DEVICES = "devices.msgpack"
RNG = "rng.bin"
_ENCODE = Encoder().encode
_READ_LIMITS = Limits(max_message=1 << 30, max_list=1 << 22)


class DurableStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)  # kept tensors: this user only

    def _folder(self, owner: str, session: str, kept: str | None = None) -> Path:
        folder = self.root / (owner or "anonymous") / session
        return folder / kept if kept is not None else folder

    def write(
        self,
        owner: str,
        session: str,
        kept: str,
        wire: Any,
        tensors: list,
        devices: list[int],
        rng: torch.Tensor,
    ) -> None:
        """Keep (wire, tensors, their device indices) on disk under the names; replaces what was
        there."""
        folder = self._folder(owner, session, kept)
        partial = folder.with_name(f".{kept}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        (partial / TREE).write_bytes(_ENCODE(wire))
        host = {str(i): t.detach().cpu().contiguous() for i, t in enumerate(tensors)}
        torch.save(host, partial / TENSORS)
        (partial / DEVICES).write_bytes(_ENCODE(list(devices)))
        rng_partial = folder.parent / f".{RNG}.partial"
        rng_partial.write_bytes(bytes(rng.numpy().tobytes()))
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        rng_partial.rename(folder.parent / RNG)

    def read(
        self, owner: str, session: str, kept: str, devices: tuple[torch.device, ...]
    ) -> tuple[Any, list, list[int]]:
        """(wire, tensors, device indices) of a kept object, each tensor on its device."""
        folder = self._folder(owner, session, kept)
        wire = unpack_one((folder / TREE).read_bytes(), _READ_LIMITS)
        host = torch.load(folder / TENSORS, weights_only=True, mmap=True)
        tensors = [host[str(i)] for i in range(len(host))]
        recorded = []
        if (folder / DEVICES).exists():
            recorded = unpack_one((folder / DEVICES).read_bytes(), _READ_LIMITS)
        indices = [
            i if type(i) is int and 0 <= i < len(devices) else 0
            for i in (recorded if len(recorded) == len(tensors) else [0] * len(tensors))
        ]  # fmt: skip
        moved = [
            t.to(devices[i]) if devices[i].type != "cpu" else t
            for t, i in zip(tensors, indices, strict=True)
        ]  # fmt: skip
        return wire, moved, indices

    def rng(self, owner: str, session: str) -> torch.Tensor | None:
        path = self._folder(owner, session) / RNG
        if not path.exists():
            return None
        return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)

    def forget(self, owner: str, session: str, kept: str | None = None) -> None:
        shutil.rmtree(self._folder(owner, session, kept), ignore_errors=True)

    def sessions(self) -> Iterator[tuple[str, str, list[str]]]:
        """(owner, session name, kept names) of everything on disk."""
        for owner_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            owner = "" if owner_dir.name == "anonymous" else owner_dir.name
            for session_dir in sorted(p for p in owner_dir.iterdir() if p.is_dir()):
                if not valid_session_name(session_dir.name):
                    continue
                kept = sorted(
                    p.name for p in session_dir.iterdir()
                    if p.is_dir() and not p.name.startswith(".") and (p / TREE).exists()
                )  # fmt: skip
                if kept:
                    yield owner, session_dir.name, kept
