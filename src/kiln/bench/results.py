"""The `kiln bench` result file: versioned JSON, one per run, named `<date>-<device-slug>[-suffix].json`.

Schema (version 1):
{
  "kind": "kiln-bench", "schema_version": 1,
  "metadata": {"date", "device", "device_type" ("cuda"|"cpu"), "device_name", "driver", "cuda",
               "torch", "triton", "jax", "python", "git_commit", "git_dirty", "timing" (what the
               numbers are: "CPU timings" or "CUDA timings"), "suite", "backend" (the one forced
               with --backend, or "dispatch"),
               "environment" (kiln.environment: commit and its source, GPU, CPU model and ISA flags,
               versions, and "fallbacks": every kiln.fallbacks entry the process took)},
  "ceilings": {"device_name", "bandwidth_gbs", "matmul_tflops": {dtype: TFLOP/s}, "method", "measured_at"},
  "cases": [{
      "op", "shape" (dict), "dtype", "backend", "method" (cuda-graph|cuda-events|cpu-wallclock),
      "median_ms", "p20_ms", "p80_ms", "rel_spread", "reps", "copies",
      "flops", "bytes", "tflops", "gbps", "intensity", "roofline_bound_ms", "roofline_fraction", "limiter",
      "baselines": {name: {"median_ms", "p20_ms", "p80_ms", "speedup"} or {"error"}},
      "error" (null, or why the case did not run: then the timing fields are null),
      "fallback" (null, or the fallback that replaced the asked-for kernel, e.g. "gemm_tma->pointer: ...":
                  then "backend" is "<asked>-><what ran>", e.g. "triton->triton_pointer")
  }]
}
Files written before "environment" and "fallback" existed still load: both are optional.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from kiln import fallbacks
from kiln.environment import environment

KIND = "kiln-bench"
SCHEMA_VERSION = 1

CASE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "op": str,
    "shape": dict,
    "dtype": str,
    "backend": str,
    "method": (str, type(None)),
    "median_ms": (float, type(None)),
    "p20_ms": (float, type(None)),
    "p80_ms": (float, type(None)),
    "rel_spread": (float, type(None)),
    "reps": (int, type(None)),
    "copies": (int, type(None)),
    "flops": (float, int),
    "bytes": (float, int),
    "tflops": (float, type(None)),
    "gbps": (float, type(None)),
    "intensity": (float, type(None)),
    "roofline_bound_ms": (float, type(None)),
    "roofline_fraction": (float, type(None)),
    "limiter": (str, type(None)),
    "baselines": dict,
    "error": (str, type(None)),
}
METADATA_FIELDS = (
    "date",
    "device",
    "device_type",
    "device_name",
    "driver",
    "cuda",
    "torch",
    "triton",
    "jax",
    "python",
    "git_commit",
    "git_dirty",
    "timing",
    "suite",
    "backend",
)
# optional fields, checked when present
OPTIONAL_CASE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "fallback": (str, type(None)),
    "rotated_bytes": (float, int, type(None)),
}


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def collect_metadata(
    device: torch.device, device_name: str, suite: str | None, backend: str | None = None
) -> dict[str, Any]:
    """Run metadata; `backend` is the implementation forced with --backend, None = dispatch's choice.
    The commit comes from kiln.environment (KILN_COMMIT, git, or the .kiln-commit file)."""
    env = environment()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": str(device),
        "device_type": device.type,
        "device_name": device_name,
        "driver": _driver() if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": env["triton"],
        "jax": env["jax"],
        "python": platform.python_version(),
        "git_commit": env["git_commit"],
        "git_dirty": env["git_dirty"],
        "timing": "CUDA timings" if device.type == "cuda" else "CPU timings",
        "suite": suite,
        "backend": backend or "dispatch",
        "environment": env,
    }


def mark_fallbacks(cases: list[dict], taken: list[dict]) -> list[dict]:
    """Every case of an (op, backend) that a recorded fallback replaced (kiln.fallbacks.REPLACES) gets
    `fallback` ("kind: detail") and `backend` "<asked>-><what ran>" (e.g. "triton->triton_pointer"),
    so it is neither reported nor compared under the kernel's own name; every other case gets
    `fallback: None`."""
    for case in cases:
        case.setdefault("fallback", None)
        hit = fallbacks.replacement(case["op"], case["backend"], taken) if case["error"] is None else None
        if hit is not None:
            entry, ran = hit
            case["fallback"] = f"{entry['kind']}: {entry['detail']}"
            case["backend"] = f"{case['backend']}->{ran}"
    return cases


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def result_filename(metadata: dict, suffix: str | None = None) -> str:
    date = metadata["date"][:10]
    name = f"{date}-{device_slug(metadata['device_name'])}"
    return f"{name}-{device_slug(suffix)}.json" if suffix else f"{name}.json"


def make_payload(metadata: dict, ceilings: dict, cases: list[dict]) -> dict:
    """The result file's content. The fallbacks taken by now (the run is over) go into
    metadata.environment.fallbacks and mark the cases they affected (mark_fallbacks)."""
    taken = fallbacks.taken()
    if "environment" in metadata:
        metadata = {**metadata, "environment": {**metadata["environment"], "fallbacks": taken}}
    payload = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "metadata": metadata,
        "ceilings": ceilings,
        "cases": mark_fallbacks(cases, taken),
    }
    validate(payload)
    return payload


def validate(payload: dict) -> None:
    """Raise ValueError naming the first missing or mistyped field."""
    if payload.get("kind") != KIND:
        raise ValueError(f"not a kiln bench result (kind={payload.get('kind')!r})")
    if payload.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"kiln bench result schema_version {payload.get('schema_version')!r}, "
            f"this Kiln reads {SCHEMA_VERSION}"
        )
    for key in ("metadata", "ceilings", "cases"):
        if key not in payload:
            raise ValueError(f"kiln bench result: missing {key!r}")
    missing = [k for k in METADATA_FIELDS if k not in payload["metadata"]]
    if missing:
        raise ValueError(f"kiln bench result: metadata lacks {', '.join(missing)}")
    for i, case in enumerate(payload["cases"]):
        for name, types in CASE_FIELDS.items():
            if name not in case:
                raise ValueError(f"kiln bench result: case {i} lacks {name!r}")
            if not isinstance(case[name], types):
                raise ValueError(
                    f"kiln bench result: case {i} field {name!r} has type {type(case[name]).__name__}"
                )
        for name, types in OPTIONAL_CASE_FIELDS.items():
            if name in case and not isinstance(case[name], types):
                raise ValueError(
                    f"kiln bench result: case {i} field {name!r} has type {type(case[name]).__name__}"
                )


def write(payload: dict, out_dir: str | Path, suffix: str | None = None) -> Path:
    """Write the result as out_dir/<date>-<device>[-suffix].json, or with -2, -3, ... before .json when
    that name is taken (a second run the same day overwrote the first); returns the path written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / result_filename(payload["metadata"], suffix)
    stem, n = path.stem, 2
    while path.exists():
        path, n = path.with_name(f"{stem}-{n}.json"), n + 1
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def load(path: str | Path) -> dict:
    try:
        payload = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"kiln bench: no such result file {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"kiln bench: {path} is not JSON ({exc})") from None
    validate(payload)
    return payload


def case_key(case: dict) -> tuple[str, str, str, str]:
    """What identifies a case across runs: (op, shape as canonical JSON, dtype, backend asked for: a
    fallback's "triton->triton_pointer" is the triton case, run another way)."""
    backend = case["backend"].split("->")[0]
    return case["op"], json.dumps(case["shape"], sort_keys=True, default=str), case["dtype"], backend


def host_of(metadata: dict) -> dict:
    """What makes timings comparable: device type and name, and on the CPU its model, id and ISA flags
    (the CPU differs from one machine to the next; a speed is a ratio on one host)."""
    env = metadata.get("environment") or {}
    host = {"device_type": metadata.get("device_type"), "device_name": metadata.get("device_name")}
    if metadata.get("device_type") == "cpu":
        host.update({k: env.get(k) for k in ("cpu_model", "cpu_id", "cpu_flags")})
    return host
