"""Tensor file formats read and written on the server: safetensors (single or sharded), the
`torch.save` format under `weights_only=True` rules, raw binary and `.npy`.

Reading goes straight to the session's device: on a CPU server, safetensors and raw files are
mapped copy-on-write (the page cache becomes the tensor's memory; writing the tensor never
changes the file); on a GPU, they are read and copied to device memory. No format is unpickled
beyond what `torch.load(weights_only=True)` allows.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from pathlib import Path
from typing import Any

import torch

from .datadirs import FileRefused

SAFETENSORS_INDEX = ".safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20
NPY_MAGIC = b"\x93NUMPY"


def _safetensors():
    try:
        import safetensors.torch  # noqa: F401
        from safetensors import safe_open
    except ImportError:
        raise FileRefused(
            "this rgpu server cannot read or write safetensors files: install the safetensors "
            "package where it runs (pip install safetensors, or jupyter-rgpu[files])"
        ) from None
    return safe_open


def load_safetensors(
    file: Path, device: torch.device, dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """A safetensors file, or a sharded checkpoint's index (`*.safetensors.index.json`), as one
    dict of tensors on `device`; and the file's metadata."""
    if file.name.endswith(SAFETENSORS_INDEX):
        return _load_sharded(file, device, dtype)
    safe_open = _safetensors()
    where = "cpu" if device.type == "cpu" else str(device)
    try:
        with safe_open(str(file), framework="pt", device=where) as f:
            metadata = f.metadata()
            tensors = {name: _cast(f.get_tensor(name), dtype) for name in f.keys()}
    except FileRefused:
        raise
    except Exception as e:  # a truncated or corrupted file: safetensors says what it found
        raise FileRefused(f"{file.name} is not a valid safetensors file: {e}") from None
    return tensors, metadata


def _load_sharded(
    index: Path, device: torch.device, dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise FileRefused(f"{index.name} is too large for a checkpoint index")
    try:
        spec = json.loads(index.read_text())
        weight_map = spec["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise FileRefused(f"{index.name} is not a safetensors index (no weight_map)") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        if type(shard) is not str or "/" in shard or shard.startswith("."):
            raise FileRefused(f"{index.name} names a shard outside its folder: {shard!r}")
        path = index.parent / shard
        if not path.is_file():
            raise FileRefused(f"{index.name} names the shard {shard!r}, which is missing")
        part, _ = load_safetensors(path, device, dtype)
        tensors.update(part)
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise FileRefused(
            f"the shards of {index.name} lack {len(missing)} tensor(s), e.g. {missing[0]!r}"
        )
    meta = spec.get("metadata")
    return tensors, {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else None


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or t.dtype == dtype or not (t.is_floating_point() or t.is_complex()):
        return t
    return t.to(dtype)


def save_safetensors(
    tensors: dict[str, torch.Tensor], partial: Path, metadata: dict[str, str] | None
) -> None:
    _safetensors()
    from safetensors.torch import save_file

    seen: dict[tuple, str] = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        if t.numel() and key in seen:
            raise FileRefused(
                f"{name!r} and {seen[key]!r} are the same tensor (tied weights): safetensors stores "
                "each once; save one of the names"
            )
        seen[key] = name
    host = {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
    try:
        save_file(host, str(partial), metadata=metadata)
    except ValueError as e:
        raise FileRefused(f"cannot save these tensors as safetensors: {e}") from None


def load_torch(file: Path, device: torch.device) -> Any:
    """`torch.load(file, weights_only=True)`, its tensors on `device`."""
    try:
        return torch.load(
            str(file), map_location=device, weights_only=True, mmap=device.type == "cpu"
        )
    except Exception as e:
        text = str(e)
        what = text.split("\n")[0]
        if "Weights only load failed" in text or "Unsupported global" in text:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            what = f"it holds a {found.group(1)}" if found else "it holds objects"
            raise FileRefused(
                f"{file.name} cannot be read under torch.load(weights_only=True) rules: {what}; "
                "rgpu loads tensors, containers and plain values only (no unpickling). Save a "
                "state_dict rather than a whole model."
            ) from None
        raise FileRefused(f"{file.name} is not a torch.save file rgpu can read: {what}") from None


def save_torch(obj: Any, partial: Path) -> None:
    torch.save(obj, str(partial))


def npy_header(file: Path) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, data offset) of a C-ordered .npy file."""
    import ast

    with open(file, "rb") as f:
        head = f.read(10)
        if len(head) < 10 or not head.startswith(NPY_MAGIC):
            raise FileRefused(f"{file.name} is not a .npy file")
        major = head[6]
        if major == 1:
            n = int.from_bytes(head[8:10], "little")
            start = 10
        else:
            f.seek(8)
            n = int.from_bytes(f.read(4), "little")
            start = 12
        if n > 1 << 20:
            raise FileRefused(f"{file.name} has an oversized .npy header")
        f.seek(start)
        text = f.read(n).decode("latin1")
    try:
        header = ast.literal_eval(text)  # a dict literal, by the format's definition
        descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    except (ValueError, SyntaxError, KeyError, TypeError):
        raise FileRefused(f"{file.name} has a .npy header rgpu cannot read") from None
    if fortran:
        raise FileRefused(f"{file.name} is stored in Fortran order; save it C-ordered")
    dtype = NPY_DTYPES.get(str(descr).lstrip("<|="))
    if dtype is None or str(descr).startswith(">"):
        raise FileRefused(f"{file.name} holds numpy dtype {descr!r}, which rgpu does not read")
    return dtype, [int(s) for s in shape], start + n


NPY_DTYPES = {
    "f2": torch.float16, "f4": torch.float32, "f8": torch.float64, "c8": torch.complex64,
    "c16": torch.complex128, "i1": torch.int8, "i2": torch.int16, "i4": torch.int32,
    "i8": torch.int64, "u1": torch.uint8, "u2": torch.uint16, "u4": torch.uint32,
    "u8": torch.uint64, "b1": torch.bool,
}  # fmt: skip


def load_raw(
    file: Path, size: int, dtype: torch.dtype, shape: list[int] | None, offset: int,
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """Bytes of a file from `offset` as a tensor of `dtype` (and `shape`, else 1-D)."""
    item = dtype.itemsize
    if offset < 0 or offset > size:
        raise FileRefused(f"offset {offset} is outside {file.name} ({size} bytes)")
    if shape is None:
        if (size - offset) % item:
            raise FileRefused(
                f"{file.name} has {size - offset} bytes after offset {offset}, not a whole number "
                f"of {dtype} elements; give a shape"
            )
        shape = [(size - offset) // item]
    count = 1
    for s in shape:
        if type(s) is not int or s < 0:
            raise FileRefused(f"shape {shape} must be non-negative integers")
        count *= s
    if offset + count * item > size:
        raise FileRefused(
            f"shape {shape} of {dtype} needs {count * item} bytes from offset {offset}, but "
            f"{file.name} has {size - offset}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    with open(file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
    t = torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset).view(shape)
    return t if device.type == "cpu" else t.to(device)


def file_size(file: Path) -> int:
    return os.stat(file).st_size
