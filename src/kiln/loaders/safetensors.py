"""HF checkpoints: config.json + model.safetensors, or shards listed in model.safetensors.index.json.

Only safetensors are read (never pickle). Quantized checkpoints (config.json `quantization_config`:
compressed-tensors, block FP8, AWQ, GPTQ) are read through kiln.loaders.quantized. Tensors are
opened lazily (memory-mapped) and loaded one at a time as the model is built. Headers are validated
first (every entry's dtype, shape and byte range; ranges contiguous, not overlapping, inside the
file) and config.json's types and sizes, so a malformed or truncated file fails with a
ModelLoadError naming it, the tensor or the key.
"""

from __future__ import annotations

import json
import math
import os

from kiln.loaders.config_checks import HF_KEYS, check_hf_config, check_model_config, is_int, json_type
from kiln.loaders.quantized import quantized_loaders
from kiln.loaders.sparse import sparse_loaders
from kiln.models.config import ModelConfig, ModelLoadError
from kiln.models.weights import WeightStore

# bytes per element of each safetensors dtype Kiln may meet (the format's list, sub-byte types aside)
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
    "C64": 8, "F64": 8, "I64": 8, "U64": 8,
}  # fmt: skip
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc


def _shard_files(directory: str) -> list[str]:
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: no 'weight_map'")
        for name, file in weight_map.items():
            if not isinstance(file, str) or not file or os.path.basename(file) != file:
                raise ModelLoadError(f"{index_path}: tensor {name!r} maps to {file!r}, expected a file name")
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
    """Reject a malformed header or a file shorter than its header says (a truncated download)."""
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
        if header_len > _MAX_HEADER_BYTES:
            raise ModelLoadError(f"{path}: safetensors header of {header_len} bytes, over the 100 MB limit")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ModelLoadError(f"{path}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(
            f"{path}: the safetensors header is a JSON {json_type(header)}, expected an object"
        )
    ranges = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ModelLoadError(f"{path}: __metadata__ must be an object of strings")
            continue
        ranges.append((*_tensor_range(path, name, entry), name))
    # the data section is the tensors back to back, in any order: no overlap, no gap
    end, previous = 0, None
    for begin, stop, name in sorted(ranges):
        if begin < end:
            raise ModelLoadError(
                f"{path}: tensors {previous!r} and {name!r} overlap (bytes {begin}..{end} of the data)"
            )
        if begin > end:
            raise ModelLoadError(f"{path}: a gap before tensor {name!r} (bytes {end}..{begin} of the data)")
        end, previous = stop, name
    if 8 + header_len + end > size:
        raise ModelLoadError(
            f"{path}: truncated safetensors file, tensor {previous!r} ends at byte {8 + header_len + end}, "
            f"file has {size}"
        )


def _tensor_range(path: str, name: str, entry) -> tuple[int, int]:
    """[begin, end) of one header entry's data, after checking its dtype, shape and size agree."""
    if not isinstance(entry, dict):
        raise ModelLoadError(
            f"{path}: tensor {name!r}: expected an object with dtype, shape and data_offsets"
        )
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if offsets is None:
        raise ModelLoadError(f"{path}: tensor {name!r}: no data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
        raise ModelLoadError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise ModelLoadError(f"{path}: tensor {name!r}: shape {shape!r}, expected a list of sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)) or not (
        0 <= offsets[0] <= offsets[1]
    ):
        raise ModelLoadError(
            f"{path}: tensor {name!r}: data_offsets {offsets!r}, expected [begin, end], begin <= end"
        )
    need = math.prod(shape) * _DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        raise ModelLoadError(
            f"{path}: tensor {name!r}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, its "
            f"{dtype} shape {shape} needs {need}"
        )
    return offsets[0], offsets[1]


def load_safetensors_dir(directory: str) -> tuple[ModelConfig, WeightStore]:
    """(config, weights) of an HF model directory."""
    from safetensors import safe_open

    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{directory}: no config.json")
    hf = check_hf_config(_read_json(config_path), config_path)
    try:
        config = ModelConfig.from_hf(hf, config_path)
    except ModelLoadError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as exc:
        raise ModelLoadError(f"{config_path}: invalid config ({type(exc).__name__}: {exc})") from exc
    check_model_config(config, config_path, HF_KEYS)
    loaders = {}
    for path in _shard_files(directory):
        _check_header(path)
        try:
            handle = safe_open(path, framework="pt")
            keys = list(handle.keys())
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot open safetensors file ({exc})") from exc
        for name in keys:
            if name in loaders:
                raise ModelLoadError(f"{path}: tensor {name!r} is in more than one shard")
            shape = tuple(handle.get_slice(name).get_shape())
            loaders[name] = (shape, lambda handle=handle, name=name: handle.get_tensor(name))
    # a quantization_config / sparsity_config: each quantized or 2:4 Linear's tensors become one weight
    # (kiln.loaders.quantized, kiln.loaders.sparse)
    loaders = sparse_loaders(hf, quantized_loaders(hf, loaders, directory), directory)
    return config, WeightStore(directory, loaders)
