"""Autocast for "rgpu": `torch.autocast("rgpu", dtype=torch.bfloat16)` with CUDA's op policy.

Autocast runs on the client, above autograd, so the casts are part of the graph; the server only
sees the resulting lower-precision ops. PyTorch ships no AutocastPrivateUse1 kernels, so every op
falls through by default and the ops below get Python kernels that cast their arguments, following
CUDA's lists (aten/src/ATen/autocast_mode.cpp): matmuls and convolutions run in the autocast dtype,
numerically sensitive ops in float32, and mixed-input ops in their widest dtype.
"""

from __future__ import annotations

from typing import Any

import torch

KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

LOWER = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm",
    "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "scaled_dot_product_attention",
    # whole recurrent layers (sent whole without grad mode): CUDA casts cuDNN's RNN, weights and
    # states included (aten/src/ATen/cudnn/AutocastRNN.cpp); uncast, an LSTM came back float32
    # without grad mode and bfloat16 with it
    "lstm", "gru", "rnn_tanh", "rnn_relu",
)  # fmt: skip
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    # CUDA's "fp32_set_opt_dtype" and "fp32_append_dtype" ops, run in float32 here as well
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum", "norm", "cross_entropy_loss",
)  # fmt: skip
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "scatter_add", "tensordot",
)  # fmt: skip
BANNED = ("binary_cross_entropy",)

_LOW = (torch.float16, torch.bfloat16)


def _eligible(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.device.type == "rgpu"
        and t.dtype != torch.float64
    )


def _cast(x: Any, dtype: torch.dtype, only_low: bool = False) -> Any:
    if _eligible(x) and x.dtype != dtype and (not only_low or x.dtype in _LOW):
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype, only_low) for y in x)
    return x


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    widest = None
    for x in (*args, *kwargs.values()):
        for t in x if isinstance(x, (list, tuple)) else (x,):
            if _eligible(t):
                widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
    return widest


def _kernel(op: torch._ops.OpOverload, policy: str):
    def run(*args: Any, **kwargs: Any) -> Any:
        if policy == "lower":
            dtype = torch.get_autocast_dtype("rgpu")
            args, kwargs = _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}
        elif policy == "fp32":
            args, kwargs = (
                _cast(args, torch.float32, True),
                {k: _cast(v, torch.float32, True) for k, v in kwargs.items()},
            )
        elif policy == "promote":
            dtype = _widest(args, kwargs)
            if dtype is not None:
                args, kwargs = _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}
        else:
            raise RuntimeError(
                f"torch.nn.functional.{op._schema.name[6:]} and torch.nn.{op._schema.name[6:]} are unsafe "
                "to autocast. Many models use a sigmoid layer right before the binary cross entropy "
                "layer. In this case, combine the two layers using "
                "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss. "
                "binary_cross_entropy_with_logits and BCEWithLogits are safe to autocast."
            )
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*args, **kwargs)

    return run


_libs: list = []


def install() -> None:
    """Register the fallthrough and the cast kernels (once)."""
    if _libs:
        return
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, KEY)
    lib = torch.library.Library("aten", "IMPL")
    _libs.extend([fallback, lib])
    for names, policy in (
        (LOWER, "lower"),
        (FP32, "fp32"),
        (PROMOTE, "promote"),
        (BANNED, "banned"),
    ):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                # never cast into a tensor the caller passed to be written (out=, in-place): the
                # result would land in a temporary and the caller's tensor would stay unchanged
                if any(
                    a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments
                ):
                    continue
                try:
                    lib.impl(op, _kernel(op, policy), KEY)
                except RuntimeError:
                    pass  # an op that already has a kernel at this key
