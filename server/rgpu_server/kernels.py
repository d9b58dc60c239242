"""Kernels PyTorch provides only for CUDA, written in aten ops for CPU and MPS servers.

The client takes CUDA's side of every `device.type == "cpu"` branch in library code: Hugging
Face's mixture-of-experts layers count tokens per expert with `histc` on integer expert ids on
anything but a CPU, which the CPU kernel refuses. `histc` here counts integers as CUDA does.

The client's autograd and composite ops take CUDA's paths for an accelerator device: an LSTM or
GRU on rgpu becomes `_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell` and their backwards, which
exist only for CUDA. These follow the CUDA kernels (aten/src/ATen/native/cuda/RNN.cu) gate by gate,
including the layout of the workspace the backward reads, so a CPU server runs the same graph a GPU
server would.
"""

from __future__ import annotations

import torch

from . import ops

_libs: list = []


def _gates(t: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return t.chunk(n, dim=1)


def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, c, o = _gates(gates, 4)
    ig, fg, cg, og = i.sigmoid(), f.sigmoid(), c.tanh(), o.sigmoid()
    cy = fg * cx + ig * cg
    hy = og * cy.tanh()
    workspace = torch.cat([ig, fg, cg, og], dim=1)
    return hy, cy, workspace


def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    ig, fg, cg, og = _gates(workspace, 4)
    go = grad_hy if grad_hy is not None else torch.zeros_like(cy)
    goc = grad_cy if grad_cy is not None else torch.zeros_like(cy)
    tcy = cy.tanh()
    gog = go * tcy
    gcx = go * og * (1 - tcy * tcy) + goc
    gig = gcx * cg
    gfg = gcx * cx
    gcg = gcx * ig
    grad_cx = gcx * fg
    grad_gates = torch.cat(
        [gig * (1 - ig) * ig, gfg * (1 - fg) * fg, gcg * (1 - cg * cg), gog * (1 - og) * og], dim=1
    )
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_cx, grad_bias


def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_bias is not None:
        input_gates = input_gates + input_bias
        hidden_gates = hidden_gates + hidden_bias
    ir, ii, in_ = _gates(input_gates, 3)
    hr, hi, hn = _gates(hidden_gates, 3)
    rg = (ir + hr).sigmoid()
    ig = (ii + hi).sigmoid()
    ng = (in_ + rg * hn).tanh()
    hy = ng + ig * (hx - ng)
    workspace = torch.cat([rg, ig, ng, hx, hn], dim=1)
    return hy, workspace


def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    rg, ig, ng, hx, hn = _gates(workspace, 5)
    go = grad_hy
    gig = go * (hx - ng) * (1 - ig) * ig
    ghx = go * ig
    gin = go * (1 - ig) * (1 - ng * ng)
    ghn = gin * rg
    grg = gin * hn * (1 - rg) * rg
    grad_input_gates = torch.cat([grg, gig, gin], dim=1)
    grad_hidden_gates = torch.cat([grg, gig, ghn], dim=1)
    if has_bias:
        return (
            grad_input_gates,
            grad_hidden_gates,
            ghx,
            grad_input_gates.sum(0),
            grad_hidden_gates.sum(0),
        )
    return grad_input_gates, grad_hidden_gates, ghx, None, None


_histc = torch.ops.aten.histc.default._op


def histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """`histc` with CUDA's integer support (aten/src/ATen/native/cuda/SummaryOps.cu): the range
    in the input's type, bin `(x - min) * bins // (max - min)` in 64-bit integers, the top edge in
    the last bin, values outside the range not counted; floating inputs go to PyTorch's kernel."""
    if input.is_floating_point() or input.is_complex() or input.dtype is torch.bool:
        return _histc(input, bins, min, max)
    if bins <= 0:
        raise RuntimeError(f"histc(): bins must be > 0, but got {bins}")
    x = input.reshape(-1).long()
    lo, hi = int(min), int(max)
    if lo == hi and x.numel():
        lo, hi = int(x.min()), int(x.max())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if lo > hi:
        raise RuntimeError("max must be larger than min")
    x = x[(x >= lo) & (x <= hi)]
    which = ((x - lo) * bins).div(hi - lo, rounding_mode="floor").clamp_(max=bins - 1)
    return torch.bincount(which, minlength=bins).to(input.dtype)


def install(device: torch.device) -> None:
    """Register the kernels for the server's backend when PyTorch has none (once)."""
    if _libs or device.type == "cuda":
        return
    key = "MPS" if device.type == "mps" else "CPU"
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in (
        ("_thnn_fused_lstm_cell", fused_lstm_cell),
        ("_thnn_fused_lstm_cell_backward_impl", fused_lstm_cell_backward),
        ("_thnn_fused_gru_cell", fused_gru_cell),
        ("_thnn_fused_gru_cell_backward", fused_gru_cell_backward),
    ):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key):
            lib.impl(name, fn, key)
    _libs.append(lib)
    ops.CALLS["histc.default"] = histc
