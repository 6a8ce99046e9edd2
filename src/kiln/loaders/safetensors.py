"""HF checkpoints: config.json + model.safetensors, or shards listed in model.safetensors.index.json.

Only safetensors are read (never pickle). Tensors are opened lazily (memory-mapped) and loaded one
at a time as the model is built; headers are validated so a truncated file fails with its name.
"""

from __future__ import annotations

import json
import os

from kiln.models.config import ModelConfig, ModelLoadError
from kiln.models.weights import WeightStore


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc


def _shard_files(directory: str) -> list[str]:
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: no 'weight_map'")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        has_pickle = any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(directory))
        hint = " (pickle checkpoints are not loaded; convert to safetensors)" if has_pickle else ""
        raise ModelLoadError(f"{directory}: no *.safetensors weights{hint}")
    paths = [os.path.join(directory, f) for f in files]
    for path in paths:
        if not os.path.isfile(path):
            raise ModelLoadError(f"{path}: listed in model.safetensors.index.json but missing")
    return paths


def _check_header(path: str) -> None:
    """Reject a file whose data section is shorter than its header says (a truncated download)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelLoadError(f"{path}: truncated safetensors file ({size} bytes)")
        header_len = int.from_bytes(prefix, "little")
        if header_len > size - 8:
            raise ModelLoadError(
                f"{path}: truncated safetensors file (header of {header_len} bytes, file {size})"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: corrupt safetensors header ({exc})") from exc
    data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + data_end > size:
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
        raise ModelLoadError(
            f"{path}: truncated safetensors file, tensor {last!r} ends at byte {8 + header_len + data_end}, "
            f"file has {size}"
        )


def load_safetensors_dir(directory: str) -> tuple[ModelConfig, WeightStore]:
    """(config, weights) of an HF model directory."""
    from safetensors import safe_open

    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{directory}: no config.json")
    config = ModelConfig.from_hf(_read_json(config_path), config_path)
    loaders = {}
    for path in _shard_files(directory):
        _check_header(path)
        try:
            handle = safe_open(path, framework="pt")
            keys = list(handle.keys())
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot open safetensors file ({exc})") from exc
        for name in keys:
            shape = tuple(handle.get_slice(name).get_shape())
            loaders[name] = (shape, lambda handle=handle, name=name: handle.get_tensor(name))
    return config, WeightStore(directory, loaders)
