"""`F.scaled_dot_product_attention` on rgpu as one op forward and one op backward.

PyTorch picks a fused attention kernel through a C++ stub that a Python backend cannot register,
so on rgpu it would take the math path: about fifteen ops forward and as many backward, each a
message, a wrapper and an autograd node on the client, where the local CPU runs one fused kernel.
An `AutogradPrivateUse1` kernel sends the CPU's fused kernel instead when the server computes on
a CPU and the call is one that kernel takes (no mask, no dropout, dense 4-D inputs of one float
dtype, flash attention not turned off with `torch.nn.attention.sdpa_kernel`). Local CPU torch
picks the same kernel for such calls, so the results are the CPU's, bit for bit (it also fuses
some masked calls, which rgpu leaves to the math path). Graph shipping traces the same two ops, so compiled and eager training agree
exactly. Every other call (CUDA servers, masks, dropout) takes the math path as before.
"""

from __future__ import annotations

from typing import Any

import torch

from . import current as _cur

aten = torch.ops.aten
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_SDPA = aten.scaled_dot_product_attention.default
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, is_causal: bool, scale: float | None):  # type: ignore[override]
        out, lse = _FORWARD(q, k, v, 0.0, is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        gq, gk, gv = _BACKWARD(grad, q, k, v, out, lse, 0.0, ctx.is_causal, scale=ctx.scale)
        return gq, gk, gv, None, None


def _fusable(q, k, v, attn_mask, dropout_p: float, enable_gqa: bool) -> bool:
    if attn_mask is not None or dropout_p != 0.0 or enable_gqa:
        return False
    if not torch.backends.cuda.flash_sdp_enabled():  # sdpa_kernel(...) without FLASH_ATTENTION
        return False
    session = _cur._current
    if session is None or not session.device.startswith("cpu"):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        return False
    if q.size(-1) != k.size(-1) or q.size(-1) != v.size(-1) or k.size(-2) != v.size(-2):
        return False
    if q.shape[:2] != k.shape[:2] or q.shape[:2] != v.shape[:2]:
        return False  # broadcast batch or heads: the math path
    if 0 in q.shape or 0 in k.shape:
        return False
    return all(t.stride(-1) == 1 for t in (q, k, v))


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
    if _fusable(query, key, value, attn_mask, dropout_p, enable_gqa):
        return _FusedAttention.apply(query, key, value, is_causal, scale)
    return _SDPA.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def install(lib: torch.library.Library) -> None:
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
