"""Hugging Face `transformers` models whose weights never cross the link.

`from_pretrained` reads a model folder on the server (saved with `save_pretrained`, or
``hub:ORG/NAME`` in the server's Hugging Face cache): only its small JSON files come here; the
weights are loaded on the server (`rgpu.files.load_file`), and transformers' own loading builds
the model on the meta device and puts those rgpu tensors in place (its `device_map` path), so
tied weights, dtypes, key renames, non-persistent buffers and newly initialised heads are handled
as transformers handles them. `save_pretrained` writes a fine-tuned model back, on the server.
The model goes to one rgpu device (the current one, or `device_map`'s), and with several servers
the folder is read on that device's server (and written on the server holding the model).

Needs the optional extra: ``pip install jupyter-rgpu[hf]`` (transformers and accelerate).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import current as _cur
from . import device_module, devices, files
from .files import FileError
from .replies import holder

CONFIG_FILES = ("config.json", "generation_config.json")
WEIGHTS = (
    ("model.safetensors.index.json", "safetensors"),
    ("model.safetensors", "safetensors"),
    ("pytorch_model.bin", "torch"),
)


def _require() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "rgpu.hf needs transformers (and accelerate for its device_map loading): "
            "pip install jupyter-rgpu[hf]"
        ) from None
    return transformers


def _weights(path: str, names: list[str]) -> tuple[str, str]:
    for name, fmt in WEIGHTS:
        if name in names:
            return f"{path.rstrip('/')}/{name}", fmt
    raise FileError(
        f"no weights in {path!r} on the server (looked for "
        + ", ".join(name for name, _ in WEIGHTS)
        + "); save the model there with rgpu.hf.save_pretrained or model.save_pretrained"
    )


def _device_of(device_map: Any) -> int:
    """The rgpu device index a `device_map` names: one device for the whole model."""
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map is None or isinstance(device_map, int):
        return devices.index_of(device_map)
    if isinstance(device_map, (str, torch.device)):
        try:
            named = torch.device(device_map)
        except RuntimeError:  # "auto", "balanced", ...
            named = None
        if named is not None and named.type == "rgpu":
            return devices.index_of(named)
    raise ValueError(
        f"rgpu.hf.from_pretrained puts the whole model on one rgpu device: device_map=None (the "
        f"current device), 'rgpu:1' or {{'': 'rgpu:1'}}, not {device_map!r}; split it across "
        "devices afterwards with accelerate.dispatch_model"
    )


def from_pretrained(model_cls: Any, path: str, **kwargs: Any) -> Any:
    """`model_cls.from_pretrained(path, **kwargs)` with the folder and the weights on the rgpu
    server and the model on rgpu: on the current device, or on the one `device_map` names
    ("rgpu:1" or {"": "rgpu:1"}). `model_cls` is a transformers model class or Auto class;
    `dtype` (or `torch_dtype`, or "auto") and the other keyword arguments of transformers'
    `from_pretrained` are passed on."""
    _cur.current()  # connects first, if no one has yet, so that the devices are known
    dev = _device_of(kwargs.pop("device_map", None))
    with device_module.device(dev):  # the folder is read on that device's server
        return _from_pretrained(model_cls, path, dev, kwargs)


def _from_pretrained(model_cls: Any, path: str, dev: int, kwargs: dict) -> Any:
    names = files.listdir(path)
    if "config.json" not in names:
        raise FileError(f"{path!r} on the server has no config.json: is it a model folder?")
    weights, fmt = _weights(path, names)
    transformers = _require()
    with tempfile.TemporaryDirectory(prefix="rgpu-hf-") as tmp:
        for name in CONFIG_FILES:
            if name in names:
                files.download(f"{path.rstrip('/')}/{name}", Path(tmp) / name, progress=False)
        config = kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(tmp)
        generation = None
        if "generation_config.json" in names:
            generation = transformers.GenerationConfig.from_pretrained(tmp)
    mapping = getattr(model_cls, "_model_mapping", None)  # an Auto class: the class for this config
    if mapping is not None:
        try:
            model_cls = mapping[type(config)]
        except KeyError:
            raise ValueError(
                f"{model_cls.__name__} has no model for a {type(config).__name__}"
            ) from None
    state = (
        files.load_file(weights, device=dev)
        if fmt == "safetensors"
        else files.load(weights, map_location=dev)
    )
    # transformers builds the model on the meta device and puts these rgpu tensors in place
    model = model_cls.from_pretrained(
        None, config=config, state_dict=state, device_map={"": f"rgpu:{dev}"}, use_kernels=False,
        **kwargs,
    )  # fmt: skip
    if generation is not None and hasattr(model, "generation_config"):
        model.generation_config = generation
    return model


def save_pretrained(model: Any, path: str, *, safe_serialization: bool = True) -> None:
    """Write a transformers model on rgpu as a model folder on the server (config, generation
    config, ``model.safetensors``); `from_pretrained` and transformers read it back."""
    _require()
    if not safe_serialization:
        raise ValueError("rgpu.hf.save_pretrained writes safetensors only")
    state = _untied_state(model)
    _, dev = holder(state, "rgpu.hf.save_pretrained")
    with device_module.device(dev):  # the folder goes to the server holding the model
        _save_folder(model, state, path)


def _save_folder(model: Any, state: dict[str, torch.Tensor], path: str) -> None:
    with tempfile.TemporaryDirectory(prefix="rgpu-hf-") as tmp:
        model.config.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(tmp)
        for name in CONFIG_FILES:
            local = Path(tmp) / name
            if local.exists():
                files.upload(local, f"{path.rstrip('/')}/{name}", progress=False)
    files.save_file(state, f"{path.rstrip('/')}/model.safetensors", {"format": "pt"})


def _untied_state(model: Any) -> dict[str, torch.Tensor]:
    """The state dict with each tied (shared) tensor once, under the name transformers keeps."""
    state = model.state_dict()
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    if isinstance(tied, dict):
        for target in tied:
            state.pop(target, None)
    seen: dict[tuple, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        handle = getattr(t, "_r", None)
        base = getattr(handle, "base", None) or handle
        key = (id(base), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen:
            continue  # a tie transformers does not list: keep the first name
        seen[key] = name
        out[name] = t
    return out


def config_of(path: str) -> dict:
    """A model folder's config.json on the server, as a dict."""
    with tempfile.TemporaryDirectory(prefix="rgpu-hf-") as tmp:
        files.download(f"{path.rstrip('/')}/config.json", Path(tmp) / "config.json", progress=False)
        return json.loads((Path(tmp) / "config.json").read_text())
