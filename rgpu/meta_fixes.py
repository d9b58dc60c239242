"""Where running an op on meta tensors mispredicts the server's outputs, and what rgpu does.

`dispatch` predicts every op's outputs (shape, dtype, strides) by running it on meta tensors, and
the client then builds views of those outputs by itself (`x.t()`, `x[:, 1]` cost no message). A
prediction whose strides differ from the real kernel's is therefore not a cosmetic difference: a
view made from it reads the wrong elements, and the user gets a wrong number with no error. The
causes, found by comparing meta and CPU outputs of every aten op the OpInfo samples reach and of
modules on channels-last and transposed inputs (tests/test_meta_fixes.py keeps the comparison):

1. **Per-device meta kernels.** Meta kernels in `torch/_meta_registrations.py` pick the layout of
   the device `device_hint()` names, and it names CUDA for a plain meta tensor (`nonzero_static`,
   `_linalg_svd`, `linalg_eig`, the FFTs, ...). `run_meta` tells them the server's device.
2. **Pointwise ops.** The Python meta kernels of pointwise ops (which shadow the C++ ones) compute
   reduced-precision and promoted inputs in another dtype, and the conversion drops the layout of
   an expanded or broadcast input, so `a.expand(2, 3) * b.t()` in float16 was predicted row-major
   while every real kernel (TensorIterator, on any device) follows `b.t()`. `run_meta` lays such
   outputs out with TensorIterator's own rule (`tensor_iterator_strides`).
3. **Layout conventions the Python meta kernels do not follow**: `empty_like` and its family keep
   a c10-dense input's strides (`_EMPTY_LIKE`); padding lays out in the input's suggested memory
   format (`_SUGGESTED_FORMAT`). `run_meta` applies them.
4. **Outputs that differ by device in ways meta cannot know** (batch norm's saved statistics and
   layer norm's mean in reduced precision on the CPU, channels-last convolutions, `max_unpool2d`,
   the FFTs, ...). `must_ask_server` names them; dispatch then learns the layout from the server
   once per input metadata (the `LEARN` plan), or asks every time when the op writes an argument.

With `RGPU_CHECK_META=1` the server compares every prediction with what it produced and fails the
op on any difference (protocol.md, "Execution"), so a cause not covered here is a loud error.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import torch
import torch._meta_registrations as _meta_registrations

from . import dtype_meta, in_place_meta, out_meta
from .strides import empty_like_strides, row_major, tensor_iterator_strides

aten = torch.ops.aten
_local = threading.local()
_torch_device_hint = _meta_registrations.device_hint


def _device_hint(tensor: Any) -> str:
    """`torch._meta_registrations.device_hint`, answering the server's device for meta tensors
    while `run_meta` predicts an rgpu op (and torch's own answer everywhere else)."""
    device = getattr(_local, "device", None)
    if device is not None and getattr(getattr(tensor, "device", None), "type", None) == "meta":
        return device
    return _torch_device_hint(tensor)


# the meta kernels (and torch._refs) look device_hint up in this module when they run
_meta_registrations.device_hint = _device_hint


def device_type(device: str) -> str:
    """The kind of device a server computes on ("cuda:0" -> "cuda")."""
    return device.split(":", 1)[0]


def run_meta(func, args: tuple, kwargs: dict, device: str) -> Any:
    """The op's outputs on meta tensors, laid out as a `device` server will lay them out."""
    outs = out_meta.out_arguments(func, args, kwargs)
    saved = getattr(_local, "device", None)
    _local.device = "cuda" if func in _AS_CUDA else device
    try:
        if func in _BF16_ONLY and args[0].dtype != torch.bfloat16:
            out = _as_bfloat16(func, args, kwargs)
        elif func in in_place_meta.VIA_FUNCTIONAL:
            out = in_place_meta.via_functional(func, args, kwargs)
        elif dtype_meta.predicts(func, args, kwargs):
            out = dtype_meta.run(func, args, kwargs)
        elif func is _VIEW_COPY:  # its meta kernel refuses what the device copies via reshape
            out = args[0].reshape(args[1]).clone(memory_format=torch.contiguous_format)
        else:
            out = func(*args, **kwargs)
    finally:
        _local.device = saved
    if _FOLLOWS_TENSOR_ITERATOR.get(func) is None:
        _FOLLOWS_TENSOR_ITERATOR[func] = _follows_tensor_iterator(func)
    if _FOLLOWS_TENSOR_ITERATOR[func]:
        out = _relayout_pointwise(func, out, args, kwargs, device)
    else:
        name = func.__name__.split(".")[0]
        like = _EMPTY_LIKE.get(name)
        if like is not None and len(args) > like:
            out = _relayout_like(out, args[like], kwargs)
        suggested = _SUGGESTED_FORMAT.get(name)
        if suggested is not None and len(args) > suggested:
            out = _relayout_suggested(out, args[suggested])
        elif name in _CONTIGUOUS_OUTPUTS and not func._schema.is_mutable:  # out= keeps its own
            out = _relayout_contiguous(out)
    if outs:
        out_meta.lay_out(func, outs, args, kwargs, device, _follows_tensor_iterator, _predicted)
    return out


def _predicted(func, args: tuple, kwargs: dict, device: str) -> Any:
    """`run_meta`, or None for an op whose layout only the server knows (`out_meta`'s callback)."""
    return None if must_ask_server(func, args) else run_meta(func, args, kwargs, device)


_VIEW_COPY = torch.ops.aten.view_copy.default

# Ops every rgpu server runs with CUDA's semantics, whatever its device (server/kernels.py): their
# meta kernels must not refuse what only the CPU kernel refuses.
_AS_CUDA = {torch.ops.aten.histc.default}


# Ops whose meta kernel takes bfloat16 only, where the CPU kernel (and CUDA's, since torch 2.10)
# takes every floating type: predicted from bfloat16 stand-ins, their layout asked of the server.
_BF16_ONLY = {torch.ops.aten._grouped_mm.default}


def _as_bfloat16(func, args: tuple, kwargs: dict) -> Any:
    dtype = kwargs.get("out_dtype") or args[0].dtype
    a, b = (t.to(torch.bfloat16) if t.dtype == args[0].dtype else t for t in args[:2])
    return func(a, b, *args[2:], **kwargs).to(dtype)


# Ops whose output is `empty_like(argument n)` in its memory format, by n: c10 keeps that
# argument's strides when it is dense by its own definition (every empty tensor, any strides on
# size-1 dims); the Python meta kernels recompute them from a permutation, which differs there.
_EMPTY_LIKE = {
    "empty_like": 0, "zeros_like": 0, "ones_like": 0, "full_like": 0, "rand_like": 0,
    "randn_like": 0, "randint_like": 0, "flip": 0, "log_sigmoid_backward": 0,
}  # fmt: skip
# Ops that lay their output out in `argument n`'s suggested memory format (channels-last when its
# strides are, else row-major), by n; their meta kernels answer row-major.
_SUGGESTED_FORMAT = {
    "reflection_pad1d_backward": 1, "reflection_pad2d_backward": 1,
    "reflection_pad3d_backward": 1, "replication_pad1d_backward": 1,
    "replication_pad2d_backward": 1, "replication_pad3d_backward": 1,
    "replication_pad3d": 0, "reflection_pad3d": 0,
}  # fmt: skip


# Backwards whose kernels allocate every output contiguous, on the CPU and CUDA alike (layer norm
# makes its input contiguous first; the softmax backwards' structured meta asks for a contiguous
# gradient; the pointwise losses' backwards zero a contiguous gradient and write into it), and
# samplers that allocate their result by its sizes alone (normal with tensor parameters, poisson,
# gamma); their Python meta kernels follow a transposed input or gradient.
_CONTIGUOUS_OUTPUTS = {
    "native_layer_norm_backward", "_log_softmax_backward_data", "_softmax_backward_data",
    "mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward",
    "normal", "poisson", "_standard_gamma",
}  # fmt: skip


def _relayout_contiguous(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return (
            out
            if out.is_contiguous()
            else torch.empty_like(out, memory_format=torch.contiguous_format)
        )
    if isinstance(out, tuple):
        return tuple(_relayout_contiguous(o) for o in out)
    return out


def _relayout_suggested(out: Any, x: Any) -> Any:
    if not isinstance(out, torch.Tensor) or not isinstance(x, torch.Tensor) or out.dim() != x.dim():
        return out
    from torch._prims_common import suggest_memory_format

    fmt = suggest_memory_format(x)
    fixed = torch.empty(out.shape, dtype=out.dtype, device="meta", memory_format=fmt)
    return out if fixed.stride() == out.stride() else fixed


def _relayout_like(out: Any, x: Any, kwargs: dict) -> Any:
    if (
        not isinstance(out, torch.Tensor)
        or not isinstance(x, torch.Tensor)
        or kwargs.get("memory_format", torch.preserve_format) != torch.preserve_format
        or out.shape != x.shape
    ):
        return out
    strides = empty_like_strides(tuple(x.shape), x.stride())
    if out.stride() == strides:
        return out
    return torch.empty_strided(out.shape, strides, dtype=out.dtype, device="meta")


# -- 2. pointwise ops: TensorIterator's output layout ------------------------------------------

_FOLLOWS_TENSOR_ITERATOR: dict[Any, bool] = {}
# pointwise-tagged ops whose real kernels do not allocate their output through TensorIterator
_NOT_TENSOR_ITERATOR = {"clone", "masked_fill", "positive"}
_SCALAR_IS_A_PARAMETER = {aten.pow.Tensor_Scalar}  # a unary kernel with the exponent as a constant
# TensorIterator gets (self, grad_output): the output follows self's layout, not the gradient's
_OPERANDS_REVERSED = {aten.threshold_backward.default, aten.leaky_relu_backward.default}
# these allocate their output row-major themselves, then run TensorIterator into it: pow.Scalar
# (then pow.Tensor_Tensor), angle of a complex tensor (computed complex, then copied to real)
_ROW_MAJOR = {aten.pow.Scalar}


# activation backwards that are TensorIterator binary ops of (grad_output, self) on every device
# but carry no pointwise tag, and binary TensorIterator ops without the tag
_TENSOR_ITERATOR_BACKWARDS = {
    "hardswish_backward", "hardsigmoid_backward", "elu_backward", "leaky_relu_backward",
    "softplus_backward", "hardtanh_backward", "softshrink_backward", "hardshrink_backward",
    "floor_divide", "complex", "polar",
}  # fmt: skip


def _follows_tensor_iterator(func) -> bool:
    schema = func._schema
    name = func.__name__.split(".")[0]
    return (
        (torch.Tag.pointwise in func.tags or name in _TENSOR_ITERATOR_BACKWARDS)
        and not schema.is_mutable
        and name not in _NOT_TENSOR_ITERATOR
        and len(schema.returns) >= 1
        and all(str(r.type) == "Tensor" and r.alias_info is None for r in schema.returns)
    )


def _operands(func, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The op's TensorIterator operands as (argument name, value), in TensorIterator's order.

    A Python number is an operand too when the kernel wraps it in a 0-dim tensor: in a Tensor
    argument (`mul.Tensor(x, 0.5)`), or as the Scalar of a `.Scalar` overload (`add.Scalar`,
    `xlogy.Scalar_Self`, ...). A 0-dim operand takes the inputs off the fast path for operands of
    one shape, which decides the strides of size-1 dims."""
    overload = func._overloadname.lower()
    wraps_scalars = "scalar" in overload and func not in _SCALAR_IS_A_PARAMETER
    named = []
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        else:
            continue
        if isinstance(value, torch.Tensor):
            named.append((arg.name, value))
        elif isinstance(value, (bool, int, float, complex)):
            kind = str(arg.type)
            if kind == "Tensor" or (wraps_scalars and kind in ("Scalar", "number")):
                named.append((arg.name, value))
    if func in _OPERANDS_REVERSED:
        named.reverse()
    return named


def _relayout_pointwise(func, out: Any, args: tuple, kwargs: dict, device: str) -> Any:
    outs = out if isinstance(out, tuple) else (out,)
    if not all(isinstance(o, torch.Tensor) for o in outs):
        return out
    operands = _operands(func, args, kwargs)
    inputs = [(n, a) for n, a in operands if isinstance(a, torch.Tensor)]
    if not inputs or any(a.layout != torch.strided for _, a in inputs):
        return out
    shape = tuple(outs[0].shape)
    if any(tuple(o.shape) != shape or any(o is a for _, a in inputs) for o in outs):
        return out
    if func in _ROW_MAJOR or (func is aten.angle.default and inputs[0][1].is_complex()):
        strides = row_major(shape)
    elif func is aten.abs.default and inputs[0][1].is_complex():
        strides = empty_like_strides(shape, inputs[0][1].stride())  # abs_out into empty_like
    else:
        layouts = [
            ((), ()) if not isinstance(a, torch.Tensor) else (tuple(a.shape), a.stride())
            for _, a in operands
        ]
        if device == "cpu":
            # TensorIterator on the CPU first converts inputs of another dtype than the common
            # one with .to(), which lays a non-dense (expanded) input out densely (where()
            # converts self and other the same way, never its condition)
            common = _common_dtype([a for n, a in operands if n != "condition"], outs)
            layouts = [
                (s, st)
                if not isinstance(a, torch.Tensor) or n == "condition" or a.dtype == common
                else (s, empty_like_strides(s, st))
                for (n, a), (s, st) in zip(operands, layouts)
            ]
        strides = tensor_iterator_strides(layouts, shape)
    if strides is None or all(o.stride() == strides for o in outs):
        return out
    return _restrided(out, outs, shape, strides)


def _restrided(out: Any, outs: tuple, shape: tuple, strides: tuple) -> Any:
    fixed = tuple(torch.empty_strided(shape, strides, dtype=o.dtype, device="meta") for o in outs)
    return fixed if isinstance(out, tuple) else fixed[0]


def _common_dtype(values: list, outs: tuple) -> torch.dtype:
    """The dtype TensorIterator computes in: the promoted inputs, or the outputs' floating dtype
    when the op promotes integers to floats."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    _, common = elementwise_dtypes(
        *values, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
    )
    result = outs[0].dtype
    if result != torch.bool and (result.is_floating_point or result.is_complex):
        if not (common.is_floating_point or common.is_complex) or result.itemsize > common.itemsize:
            return result
    return common


# -- 3. ops whose layout only the server knows -------------------------------------------------

# The real kernels' outputs differ by device in ways no meta kernel can predict:
# - batch norm: the CPU returns empty saved statistics in eval mode and keeps reduced-precision
#   inputs' dtype for them (the meta kernels follow CUDA: size C, float32);
# - embedding_bag: the CPU leaves offset2bag / bag_size empty on its fast path;
# - FFTs, SVD, eig: strides depend on the library the device calls (cuFFT / MKL / pocketfft);
# - max_unpool2d: the CPU keeps a channels-last input's layout, CUDA does not;
# - _grouped_mm: its meta kernel pads rows for bfloat16, which `_BF16_ONLY` predicts it from;
# - ldexp, mvlgamma: compositions of several pointwise ops (CompositeExplicitAutograd), laid out
#   by neither TensorIterator's rule for one op nor their Python meta kernels.
_ASK_SERVER = re.compile(
    r"^(_linalg_svd|linalg_eig|_linalg_eig|_fft_r2c|_fft_c2r|_fft_c2c|native_batch_norm"
    r"|_native_batch_norm_legit\w*|_batch_norm_with_update\w*|_embedding_bag_forward_only"
    r"|_embedding_bag|max_unpool2d|ldexp|mvlgamma|_grouped_mm|log_sigmoid_forward)$"
)
_REDUCED = (torch.float16, torch.bfloat16)


_CONVOLUTIONS = {"convolution", "_convolution", "convolution_backward"}
_BATCH_NORM_BACKWARDS = {"native_batch_norm_backward", "batch_norm_backward"}
_BINARY_CROSS_ENTROPY = {"binary_cross_entropy", "binary_cross_entropy_backward"}
_ASK_SOMETIMES = {
    "native_layer_norm",
    *_BATCH_NORM_BACKWARDS,
    *_CONVOLUTIONS,
    *_BINARY_CROSS_ENTROPY,
}


def may_ask_server(name: str) -> bool:
    """Whether `must_ask_server` can be true for this op (checked once per op)."""
    return bool(_ASK_SERVER.match(name)) or name in _ASK_SOMETIMES


def must_ask_server(func, args: tuple) -> bool:
    """True when meta inference cannot know this op's output layout on the server."""
    name = func.__name__.split(".")[0]
    if name == "native_layer_norm":
        # layer norm's mean and rstd: float32 on CUDA, the input's dtype on the CPU
        return bool(args) and isinstance(args[0], torch.Tensor) and args[0].dtype in _REDUCED
    if name in _BATCH_NORM_BACKWARDS:
        # the gradient of a channels-last input: channels-last on the CPU in reduced precision;
        # of a transposed gradient: as the input, where the meta kernels follow the gradient
        return not all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in args[:2])
    if name in _BINARY_CROSS_ENTROPY:
        # the CPU allocates its result contiguous, CUDA like the input
        return not all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in args[:2])
    if name in _CONVOLUTIONS:
        # the meta kernels always answer contiguous; the backend the device picks (mkldnn,
        # cuDNN, ...) lays a channels-last input or weight out channels-last
        return not all(
            isinstance(t, torch.Tensor) and t.is_contiguous() for t in args[:3] if t is not None
        )
    return bool(_ASK_SERVER.match(name))
