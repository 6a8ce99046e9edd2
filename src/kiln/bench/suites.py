"""Which cases `kiln bench` runs: ops, shapes and dtypes, resolved from the registry.

A suite is a key of `OpSpec.bench_shapes` ("llm" for every op). `--shapes` overrides the suite with
a JSON shape dict or list of dicts (inline, or a path to a .json file), or names another suite.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.ops import OpSpec, all_ops


@dataclass
class Case:
    spec: OpSpec
    shape: dict
    dtype: torch.dtype


def dtype_from_name(name: str) -> torch.dtype:
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"kiln bench: unknown dtype {name!r}; use a torch dtype name such as bfloat16")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_shapes(text: str | None, spec: OpSpec, suite: str) -> list[dict]:
    """Shapes for one op: `text` as JSON (dict or list), a path to a JSON file, or a suite name;
    None means the op's shapes for `suite` (empty when the op has none)."""
    if text is None:
        return list(spec.bench_shapes.get(suite, []))
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        value = json.loads(stripped)
    elif stripped.endswith(".json") and Path(stripped).is_file():
        value = json.loads(Path(stripped).read_text())
    else:
        if stripped not in spec.bench_shapes:
            known = ", ".join(spec.bench_shapes) or "none"
            raise ValueError(
                f"kiln bench: {spec.name} has no shape suite {stripped!r} (known: {known}); "
                'or pass JSON such as \'{"rows": 64, "hidden": 4096}\''
            )
        return list(spec.bench_shapes[stripped])
    shapes = [value] if isinstance(value, dict) else value
    if not isinstance(shapes, list) or not all(isinstance(s, dict) for s in shapes):
        raise ValueError("kiln bench: --shapes must be a JSON object or a list of objects")
    return shapes


def default_dtypes(spec: OpSpec, device: torch.device) -> list[torch.dtype]:
    """bf16 on CUDA (the LLM dtype), fp32 on the CPU; the op's first dtype if it lacks that one."""
    preferred = torch.bfloat16 if device.type == "cuda" else torch.float32
    return [preferred] if preferred in spec.dtypes else [spec.dtypes[0]]


def resolve_cases(
    ops: list[str] | None, suite: str, shapes: str | None, dtypes: list[str] | None, device: torch.device
) -> list[Case]:
    """Every (op, shape, dtype) to bench. Ops default to every registered op with shapes in `suite`."""
    registry = all_ops()
    unknown = [name for name in ops or [] if name not in registry]
    if unknown:
        raise ValueError(f"kiln bench: unknown op(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    names = ops or [name for name, spec in registry.items() if spec.bench_shapes.get(suite)]
    cases = []
    for name in names:
        spec = registry[name]
        op_dtypes = [dtype_from_name(d) for d in dtypes] if dtypes else default_dtypes(spec, device)
        for dtype in op_dtypes:
            if dtype not in spec.dtypes:
                continue  # an explicit --dtype the op does not support is skipped, not an error
            for shape in parse_shapes(shapes, spec, suite):
                cases.append(Case(spec, shape, dtype))
    return cases
