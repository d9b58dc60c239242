"""File messages: tensors read from and written to the server's data directories, and plain
file access for `rgpu.files` (listing, stat, remove, and byte-range reads and writes for
uploading and downloading whole files).

Every path goes through `DataRoots` (datadirs.py); a refusal or an I/O error answers the request
with an error naming the problem, and the session goes on. Tensors a LOAD makes get the ids the
client reserved from `first_id` on, in the order of the tree's leaves.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from typing import Any

import torch

from rgpu_protocol import MAX_TREE_TENSORS, ProtocolError, Status, TensorMeta, tree

from . import formats
from .datadirs import FileRefused, partial_path
from .poison import Poison, describe
from .state import SessionState

READ_LIMIT = 16 << 20  # bytes one READ_BYTES may ask for
HASH_PIECE = 8 << 20


def _refused(s: SessionState, seq: int, what: str, e: BaseException) -> None:
    message = str(e) if isinstance(e, FileRefused) else describe(e)
    s.reply(seq, Status.ERROR, [f"rgpu.files.{what}", message])


def _roots(s: SessionState):
    if s.data is None:
        raise FileRefused(
            "this rgpu server has no data directory, so it reads and writes no files: start it "
            "with --data-dir DIR (repeatable; NAME=DIR names a root, DIR:ro makes it read-only)"
        )
    return s.data


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.is_conj(),
                      t.is_neg())  # fmt: skip


def _store_tree(s: SessionState, obj: Any, first_id: int) -> Any:
    """Keep the tensors of a loaded object under ids from `first_id` on; the object's wire form
    with their metadata in their place."""
    stored: list[int] = []

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                raise FileRefused(f"the file holds a {x.layout} tensor; rgpu loads dense tensors")
            if len(stored) >= MAX_TREE_TENSORS:
                raise FileRefused(f"the file holds more than {MAX_TREE_TENSORS} tensors")
            if x.device != s.device:
                x = x.to(s.device)
            tid = first_id + len(stored)
            s.tensors[tid] = x
            stored.append(tid)
            return _meta(x)
        if x is None or type(x) in (bool, int, float, complex, str, bytes, torch.dtype):
            return x
        if isinstance(x, torch.device):
            return str(x)
        raise FileRefused(f"the file holds a {type(x).__name__}, which rgpu cannot return")

    try:
        wire = tree.pack(obj, leaf)
    except BaseException:
        for tid in stored:
            s.tensors.pop(tid, None)
        raise
    if s.quota is not None and not s.charge("rgpu.files.load", stored, report=False):
        for tid in stored:
            s.tensors.pop(tid, None)
        raise FileRefused(s.quota.message())
    return wire


def load(s: SessionState, seq: int, msg: list) -> None:
    """[LOAD, path, format, options, first_id] -> [tree of TensorMeta and values, metadata]"""
    _, path, fmt, options, first_id = msg
    if first_id < 1:
        raise ProtocolError("LOAD first_id must be a positive integer")
    if s.error_pending(seq):
        return
    try:
        _, file, st = _roots(s).regular_file(path)
        options = options or {}
        dtype = options.get("dtype")
        if dtype is not None and type(dtype) is not torch.dtype:
            raise FileRefused("dtype must be a torch dtype")
        metadata = None
        if fmt == "safetensors":
            obj, metadata = formats.load_safetensors(file, s.device, dtype)
        elif fmt == "torch":
            obj = formats.load_torch(file, s.device)
        elif fmt in ("raw", "npy"):
            shape = options.get("shape")
            offset = options.get("offset", 0)
            if fmt == "npy":
                dtype, shape, offset = formats.npy_header(file)
            elif dtype is None:
                raise FileRefused("a raw file needs a dtype")
            if type(offset) is not int or (shape is not None and type(shape) is not list):
                raise FileRefused("offset must be an int and shape a list of ints")
            obj = formats.load_raw(file, st.st_size, dtype, shape, offset, s.device)
        else:
            raise FileRefused(f"unknown file format {fmt!r}: safetensors, torch, raw or npy")
        wire = _store_tree(s, obj, first_id)
    except (FileRefused, OSError, RuntimeError, ValueError) as e:
        _refused(s, seq, "load", e)
        return
    s.ops_run += 1
    s.reply(seq, Status.OK, [wire, metadata])


def save(s: SessionState, seq: int, msg: list) -> None:
    """[SAVE, path, format, tree of tensor references and values, metadata] -> bytes written"""
    _, path, fmt, wire, metadata = msg
    if s.error_pending(seq):
        return
    if s.bad is not None:
        bad = s.bad
        label, message = (bad.label, bad.message) if type(bad) is Poison else (
            "rgpu.files.save", s.missing_message())  # fmt: skip
        s.reply(seq, Status.ERROR, [label, message])
        return
    try:
        roots = _roots(s)
        target = roots.writable(path)
        obj = tree.unpack(wire, lambda x: x)
        if fmt == "safetensors":
            if not isinstance(obj, dict) or not all(
                type(k) is str and isinstance(v, torch.Tensor) for k, v in obj.items()
            ):
                raise FileRefused("save_file takes a dict of names to tensors")
            if metadata is not None and not (
                isinstance(metadata, dict) and all(type(v) is str for v in metadata.values())
            ):
                raise FileRefused("safetensors metadata is a dict of str to str")
            size = _write(s, target, lambda p: formats.save_safetensors(obj, p, metadata))
        elif fmt == "torch":
            size = _write(s, target, lambda p: formats.save_torch(_to_host(obj), p))
        else:
            raise FileRefused(f"unknown file format {fmt!r}: safetensors or torch")
    except (FileRefused, OSError, RuntimeError, ValueError, ProtocolError) as e:
        _refused(s, seq, "save", e)
        return
    s.reply(seq, Status.OK, size)


def _to_host(obj: Any) -> Any:
    """Tensors as CPU tensors, so the file loads anywhere (as rgpu's pickling does)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def _write(s: SessionState, target, write) -> int:
    """Write a file next to `target`, check it against the limits, and put it in place."""
    partial = partial_path(target, s.hex)
    try:
        write(partial)
        size = os.stat(partial).st_size
        _account(s, target, size)
        os.replace(partial, target)
    finally:
        if partial.exists():
            partial.unlink()
    return size


def _account(s: SessionState, target, size: int) -> None:
    """Count a file of `size` bytes replacing `target` against the session and server limits."""
    try:
        old = os.stat(target).st_size if os.path.isfile(target) else 0
    except OSError:
        old = 0
    grow = max(0, size - old)
    if s.quota is not None and s.written + grow > s.quota.limit:
        raise FileRefused(
            f"this file of {size} bytes would take the bytes this session wrote to "
            f"{s.written + grow}, past its quota of {s.quota.limit} bytes (--session-quota-mb)"
        )
    s.data.reserve(grow)
    s.written += grow


def list_dir(s: SessionState, seq: int, msg: list) -> None:
    """[LIST_DIR, path] -> [[name, is_dir, size, mtime], ...] ("" lists the default root;
    "ROOT:" another root)"""
    if s.error_pending(seq):
        return
    try:
        root, folder = _roots(s).resolve(msg[1] or ".")
        if not folder.is_dir():
            raise FileRefused(f"{msg[1]!r} is not a directory")
        entries = []
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.name.endswith(".rgpu-partial"):
                continue
            if entry.is_symlink():  # listed only when it stays inside the root
                real = os.path.realpath(entry.path)
                if real != str(root.path) and not real.startswith(str(root.path) + os.sep):
                    continue
            try:
                st = entry.stat()
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                entries.append([entry.name, stat.S_ISDIR(st.st_mode), st.st_size, st.st_mtime])
    except (FileRefused, OSError) as e:
        _refused(s, seq, "listdir", e)
        return
    s.reply(seq, Status.OK, entries)


def stat_path(s: SessionState, seq: int, msg: list) -> None:
    """[STAT, path, hash?] -> {size, mtime, is_dir, sha256?, partial} or an error"""
    _, path, with_hash = msg
    if s.error_pending(seq):
        return
    try:
        _, target = _roots(s).resolve(path)
        partial = partial_path(target, "upload")
        info: dict[str, Any] = {"partial": partial.stat().st_size if partial.exists() else 0}
        if target.exists():
            st = target.stat()
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise FileRefused(f"{path!r} is not a regular file or directory")
            info.update(size=st.st_size, mtime=st.st_mtime, is_dir=stat.S_ISDIR(st.st_mode))
            if with_hash and not info["is_dir"]:
                info["sha256"] = _sha256(target)
        else:
            info.update(size=None, mtime=None, is_dir=False)
    except (FileRefused, OSError) as e:
        _refused(s, seq, "stat", e)
        return
    s.reply(seq, Status.OK, info)


def _sha256(path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(HASH_PIECE):
            h.update(piece)
    return h.digest()


def remove(s: SessionState, seq: int, msg: list) -> None:
    """[REMOVE, path] -> bytes freed (a file, or an empty directory)"""
    if s.error_pending(seq):
        return
    try:
        roots = _roots(s)
        _, target = roots.resolve(msg[1], write=True)
        st = os.lstat(target)
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(target)
            size = 0
        elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            size = st.st_size if stat.S_ISREG(st.st_mode) else 0
            os.unlink(target)
            roots.release(size)
            s.written = max(0, s.written - size)
        else:
            raise FileRefused(f"{msg[1]!r} is not a regular file or directory")
    except FileNotFoundError:
        _refused(s, seq, "remove", FileRefused(f"no file {msg[1]!r}"))
        return
    except (FileRefused, OSError) as e:
        _refused(s, seq, "remove", e)
        return
    s.reply(seq, Status.OK, size)


def read_bytes(s: SessionState, seq: int, msg: list) -> None:
    """[READ_BYTES, path, offset, nbytes] -> bytes (fewer at the end of the file)"""
    _, path, offset, nbytes = msg
    if s.error_pending(seq):
        return
    try:
        if offset < 0 or not 0 <= nbytes <= READ_LIMIT:
            raise FileRefused(f"read at most {READ_LIMIT} bytes from a non-negative offset")
        _, file, _ = _roots(s).regular_file(path)
        with open(file, "rb") as f:
            f.seek(offset)
            data = f.read(nbytes)
    except (FileRefused, OSError) as e:
        _refused(s, seq, "download", e)
        return
    s.reply(seq, Status.OK, data)


def write_bytes(s: SessionState, seq: int, msg: list) -> None:
    """[WRITE_BYTES, path, offset, data]: into the upload's partial file (not waited: a failure
    is reported at the next wait, the COMMIT)"""
    _, path, offset, data = msg
    try:
        target = _roots(s).writable(path)
        partial = partial_path(target, "upload")
        have = partial.stat().st_size if partial.exists() else 0
        if offset > have or offset < 0:
            raise FileRefused(f"an upload of {path!r} continues at byte {have}, not {offset}")
        if s.quota is not None and s.written + offset + len(data) > s.quota.limit:
            raise FileRefused(
                f"uploading {path!r} would pass this session's quota of {s.quota.limit} bytes"
            )
        s.data.reserve(max(0, offset + len(data) - have))
        with open(partial, "r+b" if have else "wb") as f:
            f.seek(offset)
            f.write(data)
            f.truncate(offset + len(data))
    except (FileRefused, OSError) as e:
        _drop_partial(s, path)  # over a limit, or a broken write: it could not complete anyway
        if s.first_error is None:
            s.first_error = (
                "rgpu.files.upload",
                str(e) if isinstance(e, FileRefused) else describe(e),
                seq,
            )


def _drop_partial(s: SessionState, path: str) -> None:
    try:
        partial = partial_path(_roots(s).writable(path), "upload")
        size = partial.stat().st_size
        partial.unlink()
        s.data.release(size)
    except (FileRefused, OSError):
        pass


def commit(s: SessionState, seq: int, msg: list) -> None:
    """[COMMIT, path, size, sha256]: the upload's partial file becomes the file, once its size
    and hash match -> bytes"""
    _, path, size, digest = msg
    if s.error_pending(seq):
        return
    try:
        target = _roots(s).writable(path)
        partial = partial_path(target, "upload")
        if not partial.exists():
            raise FileRefused(f"no upload of {path!r} is in progress")
        have = partial.stat().st_size
        if have != size or _sha256(partial) != digest:
            partial.unlink()
            raise FileRefused(
                f"the upload of {path!r} arrived with {have} bytes and another hash than the "
                "local file's; it was dropped, upload again"
            )
        s.data.release(have)
        _account(s, target, have)
        os.replace(partial, target)
        os.utime(target, (time.time(), time.time()))
    except (FileRefused, OSError) as e:
        _refused(s, seq, "upload", e)
        return
    s.reply(seq, Status.OK, size)
