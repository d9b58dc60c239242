"""`F.scaled_dot_product_attention` on rgpu as one op forward and one op backward.

PyTorch picks a fused attention kernel through a C++ stub that a Python backend cannot register,
so on rgpu it would take the math path: about fifteen ops forward and as many backward, each a
message, a wrapper and an autograd node on the client, where the local CPU runs one fused kernel.
An `AutogradPrivateUse1` kernel sends the CPU's fused kernel instead when the server computes on
a CPU and local CPU torch would fuse the same call; PyTorch's own chooser decides that from
stand-in CPU tensors of the same layouts, so masks (a boolean one turned into 0/-inf first, as
the CPU does), grouped-query heads and `torch.nn.attention.sdpa_kernel` settings go the CPU's
way and the results are the CPU's, bit for bit: the op carries PyTorch's own autograd node, so
its backward is the CPU's fused backward too, and graph shipping traces the same two ops. Every other call (CUDA servers, dropout, a mask that
needs a gradient) takes the math path.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import current as _cur
from .tensor import Traced

aten = torch.ops.aten
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_SDPA = aten.scaled_dot_product_attention.default
_FLASH = 1  # SDPBackend.FLASH_ATTENTION, as torch._fused_sdp_choice answers


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of `t`'s layout (uninitialised, never read): the CPU's kernel choice looks at
    shapes, strides, dtypes and requires_grad only."""
    s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return s.requires_grad_() if t.requires_grad else s


# What the chooser reads besides its arguments: the `sdpa_kernel(...)` switches (those this
# torch has)
_SWITCHES = tuple(
    getattr(torch._C, name)
    for name in ("_get_flash_sdp_enabled", "_get_math_sdp_enabled",
                 "_get_mem_efficient_sdp_enabled", "_get_cudnn_sdp_enabled",
                 "_get_overrideable_sdp_enabled", "_get_math_sdp_allow_fp16_bf16_reduction")
    if hasattr(torch._C, name)
)  # fmt: skip
_CHOICES: dict = {}  # the chooser's answers by layout (decoding asks with the same few layouts)
_MAX_CHOICES = 4096  # a growing KV cache adds a layout a token: forget them all now and then


def _choice_key(q, k, v, attn_mask, *flags) -> tuple | None:
    """The chooser's inputs as a hashable key; None for tensors torch.compile is tracing."""
    try:
        tensors = tuple(
            None if t is None else (t._r.key, t.requires_grad) for t in (q, k, v, attn_mask)
        )
    except (AttributeError, Traced):
        return None
    switches = tuple(get() for get in _SWITCHES)
    return (tensors, flags, torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
            switches)  # fmt: skip


def _cpu_would_fuse(
    q, k, v, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa
) -> bool:
    """Whether local CPU torch would run this call as its fused flash kernel: asked of PyTorch's
    own chooser (`torch._fused_sdp_choice`), so masks, grouped-query heads, strides and
    `sdpa_kernel(...)` settings are decided exactly as on the CPU. Answers are kept by layout:
    asking builds CPU stand-ins the size of q, k and v."""
    session = _cur._current
    if session is None or not session.device.startswith("cpu"):
        return False
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype):
        return False  # an error on the CPU: the math path raises it
    key = _choice_key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    fused = _CHOICES.get(key) if key is not None else None
    if fused is None:
        fused = _ask_chooser(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if key is not None:
            if len(_CHOICES) >= _MAX_CHOICES:
                _CHOICES.clear()
            _CHOICES[key] = fused
    return fused


def _ask_chooser(q, k, v, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa) -> bool:
    try:
        with _disable_current_modes():  # while torch.compile traces: real CPU stand-ins, not fakes
            choice = torch._fused_sdp_choice(
                _stand_in(q), _stand_in(k), _stand_in(v),
                None if attn_mask is None else _stand_in(attn_mask),
                dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
            )  # fmt: skip
    except Exception:
        return False
    return choice == _FLASH


def _sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
):
    if _cpu_would_fuse(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # as the CPU does before its fused kernel: 0 where attending, -inf elsewhere
            keep = attn_mask
            attn_mask = torch.zeros_like(keep, dtype=query.dtype)
            attn_mask.masked_fill_(keep.logical_not(), float("-inf"))
        return _FORWARD(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return _SDPA.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def _below_autograd(func, args: tuple, kwargs: dict):
    """`_sdpa` for a call that reached the device with autograd skipped (inference mode): the
    composite as a whole has no layout of the CPU's fused kernel (its output came back with
    contiguous strides where the server's had the CPU's)."""
    return _sdpa(*args, **kwargs)


def install(lib: torch.library.Library, composite: dict) -> None:
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    composite[_SDPA] = _below_autograd
