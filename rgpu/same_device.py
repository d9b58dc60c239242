"""A CPU tensor beside rgpu tensors: refused where CUDA refuses it, taken where CUDA takes it.

Sent inline, a CPU tensor of any size worked as an argument: a layer left on the CPU was uploaded
again on every call without a word, and a backward through its weight stopped at an internal
assert of PyTorch's autograd engine (it keeps that gradient on the CPU). The check runs when an op
meets new input layouts (a plan miss in rgpu.plans), so a repeated op pays nothing for it.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import shown_briefly
from .tensor import RemoteTensor

# ops whose CUDA kernels take CPU tensors beside device ones: copies; advanced indexing (CPU
# indices, and the values `x[i] = v` writes); packed sequences' batch sizes and lengths, which
# PyTorch keeps on the CPU; CTC's lengths
_TAKE_HOST_OPS = frozenset(
    ("copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "index", "_unsafe_index",
     "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put",
     "_pack_padded_sequence", "_pack_padded_sequence_backward", "_pad_packed_sequence",
     "ctc_loss", "_ctc_loss", "_ctc_loss_backward", "_use_cudnn_ctc_loss")
)  # fmt: skip
_TAKE_HOST_OVERLOADS = frozenset(f"{rnn}.data" for rnn in ("lstm", "gru", "rnn_tanh", "rnn_relu"))


def _host_tensor(x: Any) -> torch.Tensor | None:
    """A tensor of more than one element on another device among `x` (0-dim CPU tensors are
    taken as numbers, as CUDA's kernels take them)."""
    if isinstance(x, torch.Tensor):
        if type(x) is not RemoteTensor and x.device.type != "meta" and x.dim() > 0:
            return x
    elif type(x) in (list, tuple):
        for y in x:
            found = _host_tensor(y)
            if found is not None:
                return found
    return None


def _remote_tensor(xs: tuple) -> RemoteTensor | None:
    for x in xs:
        if isinstance(x, RemoteTensor):
            return x
        if type(x) in (list, tuple):
            for y in x:
                if isinstance(y, RemoteTensor):
                    return y
    return None


def check(func: Any, wire: str | None, args: tuple, kwargs: dict) -> None:
    """Raise CUDA's error, and what to do, for a CPU tensor CUDA would not take here."""
    if wire is None or wire in _TAKE_HOST_OVERLOADS or wire.split(".", 1)[0] in _TAKE_HOST_OPS:
        return
    host = _host_tensor(args)
    if host is None and kwargs:
        host = _host_tensor(tuple(kwargs.values()))
    if host is None:
        return
    remote = _remote_tensor(args)
    if remote is None:
        remote = _remote_tensor(tuple(kwargs.values()))
    if remote is None:
        return  # `empty_like(cpu_tensor, device="rgpu")`: no rgpu tensor to mix with
    raise shown_briefly(
        RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{remote.device} and {host.device}! {func} got a {host.device} tensor of shape "
            f"{tuple(host.shape)} beside rgpu tensors: move it with .to({str(remote.device)!r}) "
            f"(a module: .to('rgpu') moves all its parameters and buffers)"
        )
    )
