"""The server's device: chosen from --device, proven to work, and named for clients."""

from __future__ import annotations

import os
import platform

import torch

from . import kernels


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    cpu = platform.processor() or platform.machine() or "cpu"
    return f"CPU ({cpu}, {os.cpu_count()} cores)"


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
