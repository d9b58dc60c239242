"""In-place ops' meta inference: the checks the CPU makes that their meta kernels skip.

TensorIterator refuses to write a result into a tensor whose dtype cannot hold it
(`long_tensor.mul_(0.5)`), but most in-place meta kernels only check shapes: the op was sent,
failed on the server, and the error came at the next wait with the tensor poisoned. The check
here runs once per plan (op and input layouts), so it costs the hot path nothing.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

# c10's names for dtypes, as the CPU's messages spell them
C10_NAMES = {
    torch.float64: "Double", torch.float32: "Float", torch.float16: "Half",
    torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
    torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool", torch.complex32: "ComplexHalf",
    torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}  # fmt: skip
_MISSING = object()
_FUNCTIONAL: dict[Any, Any] = {}  # in-place op -> its functional overload, or None


def _functional_of(func) -> Any:
    """`aten.mul.Tensor` for `aten.mul_.Tensor`: pointwise in-place ops that write `self`."""
    schema = func._schema
    name = schema.name.split("::", 1)[1]
    if (
        torch.Tag.pointwise not in func.tags
        or not name.endswith("_")
        or name.startswith("_")
        or not schema.arguments
        or schema.arguments[0].alias_info is None
        or not schema.arguments[0].alias_info.is_write
    ):
        return None
    packet = getattr(aten, name[:-1], None)
    op = getattr(packet, func._overloadname, None) if packet is not None else None
    if op is None or op._schema.is_mutable or _types(op._schema) != _types(schema):
        return None
    return op


def _types(schema) -> list:
    return [str(a.type) for a in schema.arguments]


def check_result_type(func, args: tuple, kwargs: dict) -> None:
    """Raise the CPU's error when an in-place pointwise op's result type cannot be cast to
    `self`'s dtype; `args` are meta tensors."""
    functional = _FUNCTIONAL.get(func, _MISSING)
    if functional is _MISSING:
        functional = _FUNCTIONAL[func] = _functional_of(func)
    if functional is None or not args or not isinstance(args[0], torch.Tensor):
        return
    try:
        out = functional(*args, **kwargs)
    except Exception:
        return  # the in-place meta kernel gives its own error
    if isinstance(out, torch.Tensor) and not torch.can_cast(out.dtype, args[0].dtype):
        raise RuntimeError(
            f"result type {C10_NAMES.get(out.dtype, out.dtype)} can't be cast to the desired "
            f"output type {C10_NAMES.get(args[0].dtype, args[0].dtype)}"
        )


# In-place ops whose Python meta kernel calls the functional op's overload packet: PyTorch's
# overload matching formats the tensors it rejects with repr(), which fails inside forward-mode
# AD (`torch.func.jvp` of `torch.quantile`, which uses `lerp_`). The overload itself needs none.
VIA_FUNCTIONAL = {
    aten.lerp_.Scalar: aten.lerp.Scalar,
    aten.lerp_.Tensor: aten.lerp.Tensor,
    aten.addcmul_.default: aten.addcmul.default,
    aten.addcdiv_.default: aten.addcdiv.default,
}


def via_functional(func, args: tuple, kwargs: dict) -> Any:
    out = VIA_FUNCTIONAL[func](*args, **kwargs)
    if out.shape != args[0].shape:
        raise RuntimeError(
            f"output with shape {list(args[0].shape)} doesn't match the broadcast shape "
            f"{list(out.shape)}"
        )
    check_result_type(func, args, kwargs)
    return args[0]
