"""Hugging Face `transformers` models whose weights never cross the link.

`from_pretrained` reads a model folder on the server (saved with `save_pretrained`, or
``hub:ORG/NAME`` in the server's Hugging Face cache): only its small JSON files come here; the
weights are loaded on the server (`rgpu.files.load_file`), and transformers' own loading builds
the model on the meta device and puts those rgpu tensors in place (its `device_map` path), so
tied weights, dtypes, key renames, non-persistent buffers and newly initialised heads are handled
as transformers handles them. `save_pretrained` writes a fine-tuned model back, on the server.

Needs the optional extra: ``pip install jupyter-rgpu[hf]`` (transformers and accelerate).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import files
from .files import FileError

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


def from_pretrained(model_cls: Any, path: str, **kwargs: Any) -> Any:
    """`model_cls.from_pretrained(path, **kwargs)` with the folder and the weights on the rgpu
    server and the model on rgpu. `model_cls` is a transformers model class or Auto class;
    `dtype` (or `torch_dtype`, or "auto") and the other keyword arguments of transformers'
    `from_pretrained` (except `device_map`) are passed on."""
    if "device_map" in kwargs:
        raise ValueError("rgpu.hf.from_pretrained puts the model on rgpu; drop device_map")
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
    state = files.load_file(weights) if fmt == "safetensors" else files.load(weights)
    # transformers builds the model on the meta device and puts these rgpu tensors in place
    model = model_cls.from_pretrained(
        None, config=config, state_dict=state, device_map={"": "rgpu"}, use_kernels=False, **kwargs
    )
    if generation is not None and hasattr(model, "generation_config"):
        model.generation_config = generation
    return model


def save_pretrained(model: Any, path: str, *, safe_serialization: bool = True) -> None:
    """Write a transformers model on rgpu as a model folder on the server (config, generation
    config, ``model.safetensors``); `from_pretrained` and transformers read it back."""
    _require()
    if not safe_serialization:
        raise ValueError("rgpu.hf.save_pretrained writes safetensors only")
    with tempfile.TemporaryDirectory(prefix="rgpu-hf-") as tmp:
        model.config.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(tmp)
        for name in CONFIG_FILES:
            local = Path(tmp) / name
            if local.exists():
                files.upload(local, f"{path.rstrip('/')}/{name}", progress=False)
    files.save_file(_untied_state(model), f"{path.rstrip('/')}/model.safetensors", {"format": "pt"})


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
