"""Refusals every device's kernel makes and the meta kernels skip, made at the op.

Meta inference accepts these, so the op went out and failed on the server: the error came at a
later wait, far from its line, and the op's outputs were poisoned. Each check here is one the
CPU and CUDA kernels both make, on metadata alone (dtypes, dims), with the CPU's message; checked
at a plan miss (rgpu.plans.infer), so a repeated op pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import canonicalize_dim

from .errors import shown_briefly
from .in_place_meta import C10_NAMES

aten = torch.ops.aten
_CPP_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16"}  # fmt: skip


def _name(dtype: torch.dtype) -> str:
    return C10_NAMES.get(dtype, str(dtype))


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _matrices(args: tuple, kwargs: dict, first: int = 0) -> None:
    a, b = _arg(args, kwargs, first, "self"), _arg(args, kwargs, first + 1, "mat2")
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype != b.dtype:
        raise RuntimeError(
            "expected m1 and m2 to have the same dtype, but got: "
            f"{_CPP_NAMES.get(a.dtype, _name(a.dtype))} != {_CPP_NAMES.get(b.dtype, _name(b.dtype))}"
        )


def _addmm(args: tuple, kwargs: dict) -> None:
    # addmm's own checks (LinearAlgebra.cpp, every device): the added tensor, then the factors
    mat1, mat2 = _arg(args, kwargs, 1, "mat1"), _arg(args, kwargs, 2, "mat2")
    _same_as_mat2("self", args[0], mat2)
    _same_as_mat2("mat1", mat1, mat2)


def _same_as_mat2(what: str, a: Any, mat2: Any) -> None:
    if isinstance(a, torch.Tensor) and isinstance(mat2, torch.Tensor) and a.dtype != mat2.dtype:
        raise RuntimeError(
            f"{what} and mat2 must have the same dtype, but got {_name(a.dtype)} and "
            f"{_name(mat2.dtype)}"
        )


def _linear(args: tuple, kwargs: dict) -> None:
    """With a bias, `linear` of a vector, a matrix or a contiguous batch is `addmm(bias, x,
    weight.t())`; of a strided batch, `matmul` then `add_(bias)`, which takes any dtype."""
    x, weight, bias = args[0], args[1], _arg(args, kwargs, 2, "bias")
    if isinstance(bias, torch.Tensor) and (x.dim() <= 2 or x.is_contiguous()):
        _same_as_mat2("self", bias, weight)
        _same_as_mat2("mat1", x, weight)
    _matrices(args, kwargs)


def _mv(args: tuple, kwargs: dict, first: int = 0) -> None:
    mat, vec = args[first], args[first + 1]
    if mat.dtype != vec.dtype:
        raise RuntimeError(
            f"addmv input tensors must have the same dtype, but got {_name(mat.dtype)} and "
            f"{_name(vec.dtype)}"
        )


def _convolution(args: tuple, kwargs: dict) -> None:
    x, weight = args[0], args[1]
    bias = _arg(args, kwargs, 2, "bias")
    if weight.dtype != x.dtype:
        raise RuntimeError(
            f"Input type ({_CPP_NAMES.get(x.dtype, _name(x.dtype))}) and weight type "
            f"({_CPP_NAMES.get(weight.dtype, _name(weight.dtype))}) should be the same"
        )
    if isinstance(bias, torch.Tensor) and bias.dtype != x.dtype:
        raise RuntimeError(
            f"Input type ({_CPP_NAMES.get(x.dtype, _name(x.dtype))}) and bias type "
            f"({_CPP_NAMES.get(bias.dtype, _name(bias.dtype))}) should be the same"
        )


def _index_select(args: tuple, kwargs: dict) -> None:
    index = _arg(args, kwargs, 2, "index")
    if isinstance(index, torch.Tensor) and index.dtype not in (torch.int32, torch.int64):
        raise RuntimeError("index_select(): Expected dtype int32 or int64 for index")


def _sort(args: tuple, kwargs: dict) -> None:
    x = args[0]
    dim = kwargs.get("dim", -1)
    if len(args) > 1 and type(args[1]) is int:
        dim = args[1]  # sort.default(self, dim, descending); sort.stable takes them by keyword
    canonicalize_dim(max(x.dim(), 1), dim)  # IndexError: "Dimension out of range (...)"


def _std_var(args: tuple, kwargs: dict) -> None:
    x = args[0]
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise RuntimeError("std and var only support floating point and complex dtypes")


def _softmax(args: tuple, kwargs: dict) -> None:
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim")
    if type(dim) is int:
        canonicalize_dim(max(x.dim(), 1), dim)  # IndexError: "Dimension out of range (...)"
    dtype = _arg(args, kwargs, 2, "dtype")  # softmax.int's; _softmax's third is half_to_float
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return
    if not x.dtype.is_floating_point:
        raise NotImplementedError(f"\"softmax\" not implemented for '{_name(x.dtype)}'")


def _nll_target(args: tuple, kwargs: dict) -> None:
    target = _arg(args, kwargs, 1, "target")
    if isinstance(target, torch.Tensor) and target.dtype not in (torch.int64, torch.uint8):
        raise RuntimeError(
            f"expected target dtype to be Long or Byte, but got {_name(target.dtype)}"
        )
    _param(args[0], _arg(args, kwargs, 2, "weight"))


def _param(x: torch.Tensor, p: Any) -> None:
    """A parameter the kernel reads as the input's dtype (`data_ptr<scalar_t>`)."""
    if isinstance(p, torch.Tensor) and p.dtype != x.dtype:
        raise RuntimeError(f"expected scalar type {_name(x.dtype)} but found {_name(p.dtype)}")


def _norm(x: torch.Tensor, weight: Any, bias: Any) -> None:
    """layer_norm's and group_norm's parameters: the input's dtype, or float32 for a bfloat16 or
    half input (the CPU's mixed precision). The CPU's rules and messages: what they refuse,
    CUDA's kernels (parameters read as the input's type) refuse too."""
    first = weight if isinstance(weight, torch.Tensor) else bias
    if not isinstance(first, torch.Tensor):
        return
    if first.dtype == x.dtype:
        _param(x, bias)
        return
    for p in (weight, bias):
        if isinstance(p, torch.Tensor) and p.dtype != torch.float32:
            raise RuntimeError("mixed dtype (CPU): expect parameter to have scalar type of Float")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError("mixed dtype (CPU): all inputs must share same datatype.")


def _layer_norm(args: tuple, kwargs: dict) -> None:
    _norm(args[0], _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias"))


def _group_norm(args: tuple, kwargs: dict) -> None:
    _norm(args[0], _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias"))


def _binary_cross_entropy(args: tuple, kwargs: dict) -> None:
    x, target = args[0], _arg(args, kwargs, 1, "target")
    if isinstance(target, torch.Tensor) and target.dtype != x.dtype:
        raise RuntimeError(f"Found dtype {_name(target.dtype)} but expected {_name(x.dtype)}")


def _pow(args: tuple, kwargs: dict) -> None:
    x, exponent = args[0], _arg(args, kwargs, 1, "exponent")
    if (
        not (x.dtype.is_floating_point or x.dtype.is_complex)
        and type(exponent) is int
        and exponent < 0
    ):
        raise RuntimeError("Integers to negative integer powers are not allowed.")


def _multinomial(args: tuple, kwargs: dict) -> None:
    x, n = args[0], _arg(args, kwargs, 1, "num_samples")
    replacement = _arg(args, kwargs, 2, "replacement")
    if type(n) is not int:
        return
    if n <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and x.dim() > 0 and n > x.shape[-1]:
        raise RuntimeError(
            "cannot sample n_sample > prob_dist.size(-1) samples without replacement"
        )


def _long_index(op: str, index: Any) -> None:
    if isinstance(index, torch.Tensor) and index.dtype != torch.int64:
        raise RuntimeError(
            f"{op}(): Expected a long tensor for index, but got {_name(index.dtype)}"
        )


def _same_dtype(self: torch.Tensor, source: Any, message: str) -> None:
    """The CPU's refusal of a written source of another dtype; `message` names the two dtypes
    as {self} and {source}."""
    if isinstance(source, torch.Tensor) and source.dtype != self.dtype:
        raise RuntimeError(message.format(self=_name(self.dtype), source=_name(source.dtype)))


def _index_copy(args: tuple, kwargs: dict) -> None:
    self, index, source = args[0], _arg(args, kwargs, 2, "index"), _arg(args, kwargs, 3, "source")
    _long_index("index_copy_", index)
    _same_dtype(self, source, "index_copy_(): self and source expected to have the same dtype, "
                "but got (self) {self} and (source) {source}")  # fmt: skip


def _index_add(args: tuple, kwargs: dict) -> None:
    self, index, source = args[0], _arg(args, kwargs, 2, "index"), _arg(args, kwargs, 3, "source")
    if isinstance(index, torch.Tensor) and index.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(
            f"index_add_(): Expected dtype int32/int64 for index but got: {_name(index.dtype)}"
        )
    _same_dtype(self, source, "index_add_(): self ({self}) and source ({source}) must have the "
                "same scalar type")  # fmt: skip


def _index_fill(args: tuple, kwargs: dict) -> None:
    index = _arg(args, kwargs, 2, "index")
    if isinstance(index, torch.Tensor) and index.dtype != torch.int64:
        raise IndexError("index_fill_(): Expected dtype int64 for index.")


def _index_put(args: tuple, kwargs: dict) -> None:
    values, accumulate = _arg(args, kwargs, 2, "values"), _arg(args, kwargs, 3, "accumulate")
    if not accumulate and _fills_through_a_mask(args[0], _arg(args, kwargs, 1, "indices"), values):
        return
    _same_dtype(args[0], values, "Index put requires the source and "
                "destination dtypes match, got {self} for the destination and {source} for the "
                "source.")  # fmt: skip


def _fills_through_a_mask(self: torch.Tensor, indices: Any, values: Any) -> bool:
    """`x[mask] = v` with one CPU value (`torch.tensor(1.5, dtype=torch.float64)`): every
    device's index_put_ takes it as `masked_fill_(mask, v.item())`, of any dtype."""
    if not (isinstance(values, torch.Tensor) and values.device.type == "cpu"):
        return False
    if values.numel() != 1 or not isinstance(indices, (list, tuple)):
        return False
    given = [i for i in indices if i is not None]
    return (
        len(given) == 1
        and isinstance(given[0], torch.Tensor)
        and given[0].dtype == torch.bool
        and given[0].device == self.device
    )


def _put(args: tuple, kwargs: dict) -> None:
    self, index, source = args[0], _arg(args, kwargs, 1, "index"), _arg(args, kwargs, 2, "source")
    _same_dtype(self, source, "put_(): self and source expected to have the same dtype, but got "
                "self.dtype = {self} and source.dtype = {source}")  # fmt: skip
    _long_index("put_", index)


CHECKS: dict[Any, Callable[[tuple, dict], None]] = {
    aten.mm.default: _matrices,
    aten.mm.out: _matrices,
    aten.addmm.default: _addmm,
    aten.addmm.out: _addmm,
    aten.addmm_.default: _addmm,
    aten.linear.default: _linear,
    aten.mv.default: _mv,
    aten.addmv.default: lambda args, kwargs: _mv(args, kwargs, first=1),
    aten.convolution.default: _convolution,
    aten.index_select.default: _index_select,
    aten.sort.default: _sort,
    aten.sort.stable: _sort,
    aten.std.correction: _std_var,
    aten.var.correction: _std_var,
    aten.std_mean.correction: _std_var,
    aten.var_mean.correction: _std_var,
    aten._softmax.default: _softmax,
    aten.softmax.int: _softmax,
    aten.log_softmax.int: _softmax,
    aten.matmul.default: _matrices,
    aten._log_softmax.default: _softmax,
    aten.nll_loss_forward.default: _nll_target,
    aten.nll_loss2d_forward.default: _nll_target,
    aten.native_layer_norm.default: _layer_norm,
    aten.native_group_norm.default: _group_norm,
    aten.binary_cross_entropy.default: _binary_cross_entropy,
    aten.pow.Tensor_Scalar: _pow,
    aten.pow_.Scalar: _pow,
    aten.multinomial.default: _multinomial,
    # in-place writes: refused at the op, the tensor they would write is left as it was (failed
    # on the server, the op poisoned it though nothing was written)
    aten.index_copy_.default: _index_copy,
    aten.index_copy.default: _index_copy,
    aten.index_add_.default: _index_add,
    aten.index_add.default: _index_add,
    aten.index_fill_.int_Scalar: _index_fill,
    aten.index_fill_.int_Tensor: _index_fill,
    aten.index_fill.int_Scalar: _index_fill,
    aten.index_fill.int_Tensor: _index_fill,
    aten.index_put_.default: _index_put,
    aten.index_put.default: _index_put,
    aten._index_put_impl_.default: _index_put,
    aten.put_.default: _put,
    aten.put.default: _put,
}


def check(func: Any, args: tuple, kwargs: dict) -> None:
    found = CHECKS.get(func)
    if found is not None:
        try:
            found(args, kwargs)
        except (RuntimeError, IndexError, NotImplementedError) as e:
            raise shown_briefly(e) from None
