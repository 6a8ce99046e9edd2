"""What a result was measured on: the code's commit, the GPU, the CPU and its ISA, the library
versions, and every fallback the process took (kiln.fallbacks). Result writers (`kiln bench`,
`kiln verify`, scripts/gpu_check.sh) put `environment()` into each JSON they write.

The commit comes from, in order: the KILN_COMMIT variable; `git rev-parse HEAD` where the checkout
has its .git; the `.kiln-commit` file at the repository root (scripts/write_kiln_commit.sh writes it
before the tree is copied to a machine without .git, such as the GPU machine). The file holds one
line, the hash, with `-dirty` appended when tracked files had uncommitted changes.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from kiln import fallbacks

REPO_ROOT = Path(__file__).resolve().parents[2]  # src/kiln/environment.py -> the repository
COMMIT_FILE = ".kiln-commit"
# the CPU features the CPU kernels and oneDNN choose their paths by
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _split_dirty(text: str) -> tuple[str, bool]:
    text = text.strip()
    return (text[: -len("-dirty")], True) if text.endswith("-dirty") else (text, False)


def commit() -> dict[str, Any]:
    """{"git_commit", "git_dirty", "commit_source"}; every field None when no source has it."""
    value = os.environ.get("KILN_COMMIT", "").strip()
    if value:
        sha, dirty = _split_dirty(value)
        return {"git_commit": sha, "git_dirty": dirty, "commit_source": "KILN_COMMIT"}
    if (REPO_ROOT / ".git").exists():
        sha = _git("rev-parse", "HEAD")
        if sha:
            status = _git("status", "--porcelain", "--untracked-files=no")
            dirty = bool(status) if status is not None else None
            return {"git_commit": sha, "git_dirty": dirty, "commit_source": "git"}
    for folder in (REPO_ROOT, Path.cwd()):
        path = folder / COMMIT_FILE
        if path.is_file() and path.read_text().strip():
            sha, dirty = _split_dirty(path.read_text().splitlines()[0])
            return {"git_commit": sha, "git_dirty": dirty, "commit_source": str(path.name)}
    return {"git_commit": None, "git_dirty": None, "commit_source": None}


def cpu() -> dict[str, Any]:
    """{"cpu_model", "cpu_id", "cpu_flags"}: the model name, "family F model M stepping S" (virtual
    machines often name only the vendor line, e.g. "AMD EPYC", for several generations; these tell
    them apart) and the ISA_FLAGS present, from /proc/cpuinfo (None / [] where it is missing)."""
    model, flags = platform.processor() or None, []
    ids: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu_model": model, "cpu_id": None, "cpu_flags": flags}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and value:
            model = value
        elif key in ("cpu family", "model", "stepping"):
            ids.setdefault(key, value)
        elif key == "flags":
            present = set(value.split())
            flags = [flag for flag in ISA_FLAGS if flag in present]
            break  # the first processor's block has all these lines
    cpu_id = " ".join(
        f"{k.removeprefix('cpu ')} {ids[k]}" for k in ("cpu family", "model", "stepping") if k in ids
    )
    return {"cpu_model": model, "cpu_id": cpu_id or None, "cpu_flags": flags}


def threads() -> dict[str, Any]:
    """{"cpu_count", "torch_threads", "omp_num_threads"}: the logical CPUs, the intra-op threads torch
    runs with (None when torch is not imported) and OMP_NUM_THREADS as set (a CPU timing depends on
    all three)."""
    torch = sys.modules.get("torch")
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken: the record says so instead of failing the run
        return None


def gpu() -> dict[str, Any]:
    """{"gpu_name", "gpu_capability", "cuda"}; None where torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu_name": None, "gpu_capability": None, "cuda": torch.version.cuda}
    major, minor = torch.cuda.get_device_capability()
    return {"gpu_name": torch.cuda.get_device_name(), "gpu_capability": f"{major}.{minor}",
            "cuda": torch.version.cuda}  # fmt: skip


def environment() -> dict[str, Any]:
    """The whole record: commit, GPU, CPU, Python and library versions, fallbacks taken so far."""
    return {
        **commit(),
        **gpu(),
        **cpu(),
        **threads(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "jax": _version("jax"),
        "fallbacks": fallbacks.taken(),
    }
