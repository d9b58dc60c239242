"""Registering "rgpu" with PyTorch, and wiring rgpu's own modules together. Private torch APIs
are used here and nowhere else.

`_setup_privateuseone_for_python_backend` renames PrivateUse1 to "rgpu" and installs the device
guard and hooks that autograd needs (without the guard, backward on an rgpu tensor aborts the
process). Factory functions reach PrivateUse1 kernels rather than `__torch_dispatch__` (they have
no tensor argument to carry the Python key), so every aten factory gets a kernel here.

The client's modules import one another in one direction only (tensor <- plans <- dispatch <-
special_ops, ...); where a lower module must call a higher one (a RemoteTensor's
`__torch_dispatch__`, its repr, the first trace by torch.compile; the ops dispatch hands to a
handler), `register()` connects them here.
"""

from __future__ import annotations

import torch

from . import (
    accelerator,
    attention,
    autocast,
    backward_errors,
    compile,
    current,
    current_device,
    device_module,
    device_paths,
    devices,
    dispatch,
    distributed,
    generators,
    host_memory,
    lazy_modules,
    module_moves,
    nested_ops,
    numerics,
    plans,
    saving,
    special_ops,
    tensor,
    torch_load,
    whole_ops,
)

_libs: list[torch.library.Library] = []  # registrations die with their Library object
_SKIP = (
    "sparse",
    "quantized",
    "mkldnn",
    "nested",
    "cudnn",
    "miopen",
    "_make_dep_token",
    "from_file",
    "fbgemm",
    "vulkan",
    "mps",
)


def _factory_overloads() -> list:
    """aten overloads that take a `device` and no tensor, and return tensors."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified[6:].partition(".")
        if any(s in name for s in _SKIP):
            continue
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        try:
            op = getattr(packet, overload or "default")
        except AttributeError:
            continue
        schema = op._schema
        argtypes = [str(a.type) for a in schema.arguments]
        if not any(a.name == "device" for a in schema.arguments):
            continue
        if any("Tensor" in t for t in argtypes):
            continue
        if not schema.returns or not all("Tensor" in str(r.type) for r in schema.returns):
            continue
        found.append(op)
    return found


def register() -> None:
    if _libs:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    tensor.install(dispatch.dispatch, special_ops.tensor_repr, _on_first_trace, saving)
    saving.install()
    plans.SPECIAL.update(special_ops.HANDLERS)
    plans.SPECIAL.update(nested_ops.HANDLERS)
    devices.on_other_device = current_device.install
    _setup_privateuseone_for_python_backend(tensor.DEVICE_TYPE, backend_module=device_module.module)
    tensor.DEVICE = torch.device(tensor.DEVICE_TYPE, 0)
    tensor.DEVICES = [tensor.DEVICE]
    lib = torch.library.Library("aten", "IMPL")
    _libs.append(lib)
    for op in _factory_overloads():
        lib.impl(op, special_ops.factory(op), "PrivateUse1")
    lib.impl("_copy_from", special_ops.copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", special_ops.copy_from_and_resize, "PrivateUse1")
    lib.impl("_local_scalar_dense", special_ops.local_scalar_dense, "PrivateUse1")
    autocast.install()
    host_memory.install()
    module_moves.install()
    lazy_modules.install()
    distributed.install()
    torch_load.install()
    backward_errors.install()
    accelerator.install()
    generators.install()
    numerics.install(current.sessions)
    attention.install(lib, plans.COMPOSITE)
    whole_ops.install(lib, plans.COMPOSITE)
    device_paths.install(lib, plans.COMPOSITE)
    # the default optimizers only take their fast foreach path for tensor types listed here
    import torch.optim.optimizer as _opt

    if tensor.RemoteTensor not in _opt._foreach_supported_types:
        _opt._foreach_supported_types.append(tensor.RemoteTensor)


def _on_first_trace() -> None:
    """torch.compile traces a RemoteTensor for the first time (Dynamo is loaded by now)."""
    compile.ship_default_backend_graphs()
    _constants_stay_fake()
    _rgpu_frames_run_eagerly()


def _rgpu_frames_run_eagerly() -> None:
    """Dynamo never traces rgpu's own code. Between the graphs of a function with a graph break
    (`if x.sum() > 0`, `.item()`, `x[x > 0]`), Dynamo's frame hook sees rgpu's dispatch frames run
    eagerly and, taking them for user code, compiled them: a read then met a fake tensor.
    `rgpu.models` holds models to compile, and `rgpu.current_device` the wrappers user code calls
    in place of `torch.tensor` and its kin (Dynamo traces through them to PyTorch's own call),
    so they stay traceable."""
    import os
    import pkgutil

    import torch._dynamo.trace_rules as rules

    package = __name__.rpartition(".")[0]
    rules.add("rgpu_protocol")
    for module in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if module.name not in ("models", "current_device"):
            rules.add(f"{package}.{module.name}")


def _constants_stay_fake() -> None:
    """While torch.compile traces, `torch.tensor(data, device="rgpu")` must make a fake tensor.

    FakeTensorMode builds such constants on the CPU and moves them with the fake `_to_copy`
    only when it "avoids device init", which it decides by whether an accelerator is
    available; a registered PrivateUse1 device counts as one. Otherwise the data is uploaded
    for real in the middle of tracing, and the fake mode then meets a RemoteTensor it cannot
    convert (transformers' KV cache starts from `torch.tensor([])`). With CUDA available this
    also skips constant-folding of tiny CUDA constants during tracing: they stay graph ops."""
    from torch._subclasses import fake_tensor

    cls = fake_tensor.FakeTensorMode
    if getattr(cls, "_rgpu_constants_fake", False):
        return
    cls.avoid_device_init = property(lambda self: True)
    cls._rgpu_constants_fake = True
