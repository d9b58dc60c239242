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

aten = torch.ops.aten
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_SDPA = aten.scaled_dot_product_attention.default
_FLASH = 1  # SDPBackend.FLASH_ATTENTION, as torch._fused_sdp_choice answers


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of `t`'s layout (uninitialised, never read): the CPU's kernel choice looks at
    shapes, strides, dtypes and requires_grad only."""
    s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return s.requires_grad_() if t.requires_grad else s


def _cpu_would_fuse(
    q, k, v, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa
) -> bool:
    """Whether local CPU torch would run this call as its fused flash kernel: asked of PyTorch's
    own chooser (`torch._fused_sdp_choice`), so masks, grouped-query heads, strides and
    `sdpa_kernel(...)` settings are decided exactly as on the CPU."""
    session = _cur._current
    if session is None or not session.device.startswith("cpu"):
        return False
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype):
        return False  # an error on the CPU: the math path raises it
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


def install(lib: torch.library.Library) -> None:
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
