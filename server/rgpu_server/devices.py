"""The server's device: chosen from --device, proven to work, named for clients, and its live
facts (memory, utilisation) for INFO and PEEK."""

from __future__ import annotations

import os
import platform
import threading

import torch

from . import kernels


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    cpu = platform.processor() or platform.machine() or "cpu"
    threads = torch.get_num_threads()  # --threads: a client can tell a server that holds back
    return f"CPU ({cpu}, {os.cpu_count()} cores, {threads} thread{'s' * (threads != 1)} a kernel)"


def pick_device(spec: str | None) -> torch.device:
    """Turn --device into a torch.device and prove it works by allocating on it."""
    if spec in (None, "", "auto"):
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise SystemExit(f"rgpu-server: --device must be cpu, cuda, cuda:N or mps, not {spec!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                "rgpu-server: --device cuda was asked for, but this torch sees no CUDA GPU"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise SystemExit(
                f"rgpu-server: {device} does not exist; this host has {torch.cuda.device_count()} GPU(s)"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise SystemExit("rgpu-server: --device mps was asked for, but MPS is not available here")
    torch.empty(1, device=device)
    kernels.install(device)
    return device


# -- live facts (INFO and PEEK) --------------------------------------------------------------------

_nvml: dict = {}  # device index -> NVML handle, or the reason NVML cannot be used (NoNvml)


class NoNvml(str):
    """Why NVML cannot say a device's utilisation."""


_nvml_lock = threading.Lock()


def live_facts(device: torch.device) -> dict:
    """Memory in use / total and utilisation of the server's device, read now.

    Cheap (no device synchronisation, no Dynamo import): live views ask every few seconds.
    `memory_used` / `memory_total` are the whole device's (a GPU: every process on it; the CPU:
    the machine's RAM); `memory_process` is this server's share. `utilization` is a percentage
    from NVML, or None with `utilization_note` saying why.
    """
    if device.type == "cuda":
        return _cuda_facts(device)
    if device.type == "mps":
        return _mps_facts()
    return _cpu_facts()


def _cuda_facts(device: torch.device) -> dict:
    free, total = torch.cuda.mem_get_info(device)
    util, note = _nvml_utilization(device)
    return {
        "memory_used": total - free,
        "memory_total": total,
        "memory_process": torch.cuda.memory_reserved(device),
        "utilization": util,
        "utilization_note": note,
    }


def _nvml_utilization(device: torch.device) -> tuple[int | None, str]:
    """The GPU's utilisation in percent over NVML's last sample period, and where it came from."""
    with _nvml_lock:
        handle = _nvml.get(device.index)
        if handle is None:
            handle = _nvml[device.index] = _nvml_handle(device)
    if isinstance(handle, NoNvml):
        return None, str(handle)
    try:
        import pynvml

        return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu), "NVML"
    except Exception as e:  # a driver hiccup: say so, try again next time
        return None, f"NVML failed: {e}"


def _nvml_handle(device: torch.device) -> object:
    """The NVML handle of this CUDA device (matched by UUID: NVML ignores CUDA_VISIBLE_DEVICES),
    or why there is none."""
    try:
        import pynvml
    except ImportError:
        return NoNvml("no NVML on the server (pip install nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            text = str(uuid)
            return pynvml.nvmlDeviceGetHandleByUUID(
                text if text.startswith("GPU-") else f"GPU-{text}"
            )
        return pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    except Exception as e:
        return NoNvml(f"NVML unavailable: {e}")


def _mps_facts() -> dict:
    return {
        "memory_used": torch.mps.driver_allocated_memory(),
        "memory_total": torch.mps.recommended_max_memory(),
        "memory_process": torch.mps.current_allocated_memory(),
        "utilization": None,
        "utilization_note": "MPS has no utilisation counter",
    }


def _cpu_facts() -> dict:
    total, available = _meminfo()
    return {
        "memory_used": total - available if total is not None and available is not None else None,
        "memory_total": total,
        "memory_process": _rss(),
        "utilization": None,
        "utilization_note": "n/a on a CPU server",
        "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "cpus": os.cpu_count(),
    }


def _meminfo() -> tuple[int | None, int | None]:
    """The machine's RAM and how much of it is available (Linux's /proc/meminfo), in bytes."""
    try:
        with open("/proc/meminfo", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        kib = {k: int(v.split()[0]) * 1024 for k, v in fields.items() if k in _MEMINFO}
        return kib.get(b"MemTotal"), kib.get(b"MemAvailable")
    except (OSError, ValueError):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), None
        except (ValueError, OSError, AttributeError):
            return None, None


_MEMINFO = (b"MemTotal", b"MemAvailable")


def _rss() -> int | None:
    """This process's resident memory (Linux's /proc/self/statm), in bytes."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
