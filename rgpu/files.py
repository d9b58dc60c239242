"""Files on the GPU host: tensors read and written where the data is, without crossing the link.

Paths name files in the server's data directories (`rgpu-server --data-dir`): ``"gpt2/model.
safetensors"`` in the default root, ``"ckpt:run1/step100.pt"`` in the root named ckpt, and
``"hub:ORG/NAME/file"`` in the server's Hugging Face cache. The embedded server's default root is
this process's working directory (named ``local``); a server rgpu starts over SSH has the user's
home (``home``). Only metadata crosses the link for `load_file`, `load`, `from_file`, `save_file`
and `save`; `upload` and `download` move whole files, resumably, and skip a file the other side
already has (same SHA-256).

Loads land on the device named (`device=`, `map_location=`), else the current one, as torch.load
and safetensors put tensors on the device they are given. With several servers
(`rgpu.connect([A, B])`) a request goes to the server it concerns: a load to the server of its
device, a save to the server holding its tensors, the rest (listdir, upload, ...) to the current
device's server.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rgpu_protocol import MAX_TREE_TENSORS, Kind, tree

from .errors import RemoteError, RgpuError
from .progress import TransferProgress
from .replies import Session, ask, device_session, holder, unpack_tensors
from .tensor import RemoteTensor, reserve_ids

__all__ = [
    "FileError",
    "FileStat",
    "download",
    "from_file",
    "listdir",
    "load",
    "load_file",
    "remove",
    "save",
    "save_file",
    "stat",
    "upload",
]

PIECE = 4 << 20  # bytes per WRITE_BYTES / READ_BYTES message
READS_IN_FLIGHT = 4
PARTIAL = ".rgpu-partial"


class FileError(RgpuError, OSError):
    """A file request the server refused or could not carry out (the message says why)."""


@dataclass(frozen=True)
class FileStat:
    size: int
    mtime: float
    is_dir: bool


def _ask(msg: tuple, sess: Session | None = None) -> Any:
    """`msg` answered by `sess`, or by the current device's server."""
    return ask(msg, FileError, "rgpu.files", sess=sess or device_session()[0])


def _device(device: Any) -> Any:
    """`device` if it names an rgpu device ("rgpu" and None: the current one), else an error."""
    if device is None or isinstance(device, int):
        return device
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "rgpu":
        return device
    raise ValueError(
        f"rgpu.files loads onto rgpu devices ('rgpu', 'rgpu:1', an index), not {device!r}"
    )


def _load(path: str, fmt: str, options: dict | None, device: Any = None) -> tuple[Any, dict | None]:
    sess, index, local = device_session(_device(device))
    first = reserve_ids(MAX_TREE_TENSORS)
    wire, metadata = ask((Kind.LOAD, path, fmt, options, first), FileError, "rgpu.files",
                         sess=sess, device=local)  # fmt: skip
    return unpack_tensors(wire, first, sess, index), metadata


def load_file(path: str, device: Any = "rgpu", *, dtype: torch.dtype | None = None) -> dict:
    """A safetensors file (or a sharded checkpoint's ``*.safetensors.index.json``) on the server,
    as a dict of rgpu tensors on `device` ("rgpu": the current device; floating-point ones cast
    to `dtype` if given). One wait; no tensor bytes cross the link."""
    options = {"dtype": dtype} if dtype is not None else None
    tensors, _ = _load(path, "safetensors", options, device)
    return tensors


def safetensors_metadata(path: str) -> dict[str, str] | None:
    """The metadata a safetensors file on the server carries (its tensors are loaded too)."""
    _, metadata = _load(path, "safetensors", None)
    return metadata


def _save(obj: Any, path: str, fmt: str, metadata: dict[str, str] | None, what: str) -> int:
    """SAVE to the server holding the tensors of `obj`; its CPU tensors are uploaded there
    first (once, then written on the server like the rest)."""
    sess, index = holder(obj, what)

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                raise TypeError(f"rgpu.files saves dense tensors, not {x.layout}")
            x = x.detach()
            return x if isinstance(x, RemoteTensor) else x.to(f"rgpu:{index}")
        if x is None or type(x) in (bool, int, float, complex, str, bytes, torch.dtype):
            return x
        if isinstance(x, torch.device):
            return str(x)
        raise TypeError(
            f"rgpu.files.save stores tensors, containers and plain values; {type(x).__name__} "
            "is none of them (save its state_dict instead)"
        )

    return _ask((Kind.SAVE, path, fmt, tree.pack(obj, leaf), metadata), sess)


def save_file(tensors: dict, path: str, metadata: dict[str, str] | None = None) -> int:
    """Write a dict of tensors as a safetensors file on the server; the file's size. CPU tensors
    are uploaded first; rgpu tensors never leave the server."""
    if not isinstance(tensors, dict) or not all(type(k) is str for k in tensors):
        raise TypeError("save_file takes a dict of str names to tensors")
    return _save(dict(tensors), path, "safetensors", metadata, "rgpu.files.save_file")


def load(path: str, *, map_location: Any = None, weights_only: bool = True) -> Any:
    """A `torch.save` file on the server, read there under `torch.load(weights_only=True)`
    rules, with its tensors on `map_location` (an rgpu device; None or "rgpu": the current
    one): nested state dicts, optimizer states. One wait."""
    if not weights_only:
        raise ValueError("rgpu.files.load reads with weights_only=True only: nothing is unpickled")
    obj, _ = _load(path, "torch", None, map_location)
    return obj


def save(obj: Any, path: str) -> int:
    """`torch.save(obj)` written on the server (tensors stored as CPU tensors, so the file loads
    anywhere); the file's size. Only tensors, containers and plain values."""
    return _save(obj, path, "torch", None, "rgpu.files.save")


def from_file(
    path: str, dtype: torch.dtype | None = None, shape: Any = None, offset: int = 0
) -> torch.Tensor:
    """A raw binary file (from `offset`, as `dtype`, 1-D unless `shape` is given) or a ``.npy``
    file (its own dtype and shape) as an rgpu tensor, read on the server."""
    if str(path).endswith(".npy"):
        tensor, _ = _load(path, "npy", None)
        if dtype is not None and tensor.dtype != dtype:
            raise ValueError(f"{path} holds {tensor.dtype}, not {dtype}")
        return tensor if shape is None else tensor.view(shape)
    if dtype is None:
        raise TypeError("from_file needs a dtype for a raw file (e.g. torch.uint16 tokens)")
    options = {"dtype": dtype, "offset": int(offset)}
    if shape is not None:
        options["shape"] = [
            int(s) for s in (shape if isinstance(shape, (list, tuple)) else [shape])
        ]
    tensor, _ = _load(path, "raw", options)
    return tensor


def listdir(path: str = "") -> list[str]:
    """The names in a folder on the server ("" is the default root; "ROOT:" another)."""
    return [name for name, *_ in _ask((Kind.LIST_DIR, path))]


def scandir(path: str = "") -> list[tuple[str, FileStat]]:
    """(name, FileStat) of each entry of a folder on the server."""
    return [
        (n, FileStat(size, mtime, is_dir)) for n, is_dir, size, mtime in _ask((Kind.LIST_DIR, path))
    ]


def stat(path: str) -> FileStat:
    info = _ask((Kind.STAT, path, False))
    if info["size"] is None:
        raise FileError(f"no file {path!r} on the server")
    return FileStat(info["size"], info["mtime"], info["is_dir"])


def remove(path: str) -> None:
    """Remove a file (or an empty folder) on the server."""
    _ask((Kind.REMOVE, path))


# -- whole files both ways ------------------------------------------------------------------------


def _sha256(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            h.update(piece)
    return h.digest()


def upload(local: str | os.PathLike, remote: str, *, progress: bool = True) -> int:
    """Copy a local file or folder to the server; the bytes sent. A file the server already
    has with the same SHA-256 is not sent; an upload cut short (a dropped link that outlived
    the session, Ctrl-C) continues where it stopped the next time."""
    local = Path(local)
    if local.is_dir():
        sent = 0
        for file in sorted(p for p in local.rglob("*") if p.is_file()):
            sent += upload(file, f"{remote.rstrip('/')}/{file.relative_to(local).as_posix()}",
                           progress=progress)  # fmt: skip
        return sent
    if not local.is_file():
        raise FileError(f"no local file {str(local)!r}")
    size = local.stat().st_size
    digest = _sha256(local)
    info = _ask((Kind.STAT, remote, True))
    if info["size"] == size and info.get("sha256") == digest:
        return 0
    for attempt in range(2):
        start = info["partial"] if 0 < info["partial"] <= size and attempt == 0 else 0
        _send_file(local, remote, start, size, progress)
        try:
            _ask((Kind.COMMIT, remote, size, digest))
            return size - start
        except FileError as e:
            if attempt or "another hash" not in str(e):
                raise
    return size  # not reached


def _send_file(local: Path, remote: str, start: int, size: int, progress: bool) -> None:
    sess = device_session()[0]
    bar = TransferProgress(size - start if progress else 0, f"rgpu upload {local.name}")
    try:
        if size == 0:
            sess.post((Kind.WRITE_BYTES, remote, 0, b""))
        with open(local, "rb") as f:
            f.seek(start)
            offset = start
            while offset < size:
                data = f.read(min(PIECE, size - offset))
                if not data:
                    raise FileError(f"{local} shrank while it was uploaded")
                sess.post((Kind.WRITE_BYTES, remote, offset, data), data_bytes=len(data))
                offset += len(data)
                bar.update_to(offset - start)
    finally:
        bar.close()


def download(remote: str, local: str | os.PathLike, *, progress: bool = True) -> int:
    """Copy a file or folder from the server; the bytes received. A local file with the same
    SHA-256 is kept; a download cut short continues where it stopped the next time."""
    local = Path(local)
    info = _ask((Kind.STAT, remote, True))
    if info["size"] is None:
        raise FileError(f"no file {remote!r} on the server")
    if info["is_dir"]:
        got = 0
        for name in listdir(remote):
            sub = f"{remote.rstrip('/')}/{name}" if remote else name
            got += download(sub, local / name, progress=progress)
        return got
    size, digest = info["size"], info["sha256"]
    if local.is_file() and local.stat().st_size == size and _sha256(local) == digest:
        return 0
    local.parent.mkdir(parents=True, exist_ok=True)
    partial = local.with_name(local.name + PARTIAL)
    start = partial.stat().st_size if partial.is_file() and partial.stat().st_size <= size else 0
    _receive_file(remote, partial, start, size, progress)
    if _sha256(partial) != digest:
        partial.unlink()
        raise FileError(f"{remote!r} changed on the server while it was downloaded; download again")
    os.replace(partial, local)
    return size - start


def _receive_file(remote: str, partial: Path, start: int, size: int, progress: bool) -> None:
    sess = device_session()[0]
    bar = TransferProgress(size - start if progress else 0, f"rgpu download {partial.name}")
    try:
        with open(partial, "r+b" if start else "wb") as f:
            f.seek(start)
            f.truncate(start)
            offsets = list(range(start, size, PIECE))
            waiters: list = []
            done = start
            for i, offset in enumerate(offsets):
                waiters.append(sess.request_async((Kind.READ_BYTES, remote, offset, PIECE)))
                if len(waiters) >= READS_IN_FLIGHT or i == len(offsets) - 1:
                    for w in waiters:
                        try:
                            data = sess.wait_for(w)
                        except RemoteError as e:
                            raise FileError(e.remote_message) from None
                        f.write(data)
                        done += len(data)
                        bar.update_to(done - start)
                    waiters = []
    finally:
        bar.close()
