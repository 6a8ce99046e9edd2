"""The persistent autotuning cache that kernels read at run time (so production start-up does no tuning).

Keyed by (device name, Triton version, op, dtype, shape). Two layers:
  1. the user's cache, `$KILN_TUNE_CACHE` or ~/.cache/kiln/tune.json (written by `kiln tune`);
  2. caches shipped with Kiln under kiln/ops/shipped_configs/*.json (tuned on real GPUs and committed).
A tuned shape is stored twice: under its exact shape and under its bucket (integers rounded up to a
power of two), which serves the untuned shapes near it. `lookup` takes the exact entry from either
layer first, then the bucket's (user first): two tuned shapes that share a bucket each keep their own
winner (the bucket holds the later one).
A launcher calls `lookup(op, dtype, shape)` with a shape dict it builds from its arguments, and falls
back to its heuristic when that returns None. That call is the one definition of the op's key:
`kiln tune` does not rebuild it from the OpSpec's shape, it runs the launcher on the tuned inputs up
to that call (`launcher_request`) and stores the winner under exactly what the launcher asked for.

Writers (`store`, `export`) read, merge and replace the file under an exclusive `fcntl.flock` on a
sidecar `<file>.lock`, so concurrent `kiln tune` processes keep each other's entries.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # not POSIX (Windows): writers go unlocked, the rename still prevents torn files
    fcntl = None

# Tuned on real GPUs and committed, one JSON per device.
SHIPPED_DIR = Path(__file__).parent / "shipped_configs"


def device_name(device: torch.device | None = None) -> str:
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        return torch.cuda.get_device_name(device)
    return "cpu"


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


def shape_bucket(shape: dict[str, Any]) -> str:
    """Integers round up to the next power of two (so nearby shapes share a config); other values
    (flags, strings) are kept as they are. Deterministic key order."""
    parts = []
    for key in sorted(shape):
        value = shape[key]
        if isinstance(value, bool) or not isinstance(value, int):
            parts.append(f"{key}={value}")
        else:
            parts.append(f"{key}={1 << max(value - 1, 0).bit_length()}")
    return ",".join(parts)


def _prefix(op: str, dtype: torch.dtype, device: torch.device | None) -> str:
    dtype_name = str(dtype).replace("torch.", "")
    return f"{device_name(device)}|triton-{triton_version()}|{op}|{dtype_name}"


def _bucket_key(prefix: str, shape: dict[str, Any]) -> str:
    return f"{prefix}|{shape_bucket(shape)}"


def _exact_key(prefix: str, shape: dict[str, Any]) -> str:
    # "=" where the bucket's key has "|": the two never collide
    return prefix + "=" + ",".join(f"{key}={shape[key]}" for key in sorted(shape))


def exact_key(op: str, dtype: torch.dtype, shape: dict[str, Any], device: torch.device | None = None) -> str:
    """The key of this shape alone (its values as they are)."""
    return _exact_key(_prefix(op, dtype, device), shape)


def user_cache_path() -> Path:
    return Path(os.environ.get("KILN_TUNE_CACHE", Path.home() / ".cache" / "kiln" / "tune.json"))


def _read(path: Path) -> dict[str, dict]:
    try:
        return json.loads(path.read_text()).get("entries", {})
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"kiln tune cache {path} is malformed ({exc}); delete it or fix it") from None


@functools.lru_cache(maxsize=1)
def _shipped() -> dict[str, dict]:
    entries: dict[str, dict] = {}
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        entries.update(_read(path))
    return entries


_user_entries: dict[str, dict] | None = None


def _user() -> dict[str, dict]:
    global _user_entries
    if _user_entries is None:
        _user_entries = _read(user_cache_path())
    return _user_entries


@dataclass(frozen=True)
class LookupRequest:
    """One `lookup` call's arguments: what a launcher asks the cache for."""

    op: str
    dtype: torch.dtype
    shape: dict[str, Any]
    device: torch.device | None = None

    @property
    def key(self) -> str:
        """The key `store` records these arguments under (the shape's exact key)."""
        return exact_key(self.op, self.dtype, self.shape, self.device)


class _Asked(BaseException):
    """Stops a launcher at its lookup under `launcher_request`. A BaseException, so that no
    `except Exception` in a launcher can swallow it and go on to launch kernels."""

    def __init__(self, request: LookupRequest):
        super().__init__(request.op)
        self.request = request


class _Probe(threading.local):
    op: str | None = None  # the op whose lookup `launcher_request` waits for, in this thread


_probe = _Probe()


def launcher_request(launcher: Callable[..., Any], inputs: dict[str, Any], op: str) -> LookupRequest | None:
    """What `launcher(**inputs)` asks the cache for when it looks `op` up: the launcher runs only up to
    that `lookup` call (which raises back to here), so no kernel runs. None when the launcher returned
    without asking (it never reads the cache for these inputs). Lookups of other ops run as usual."""
    previous, _probe.op = _probe.op, op
    try:
        launcher(**inputs)
    except _Asked as asked:
        return asked.request
    finally:
        _probe.op = previous
    return None


def lookup(
    op: str, dtype: torch.dtype, shape: dict[str, Any], device: torch.device | None = None
) -> dict | None:
    """The tuned config for this op/dtype/shape on this device (the shape's own, else its bucket's), or
    None (use the heuristic)."""
    if _probe.op == op:  # under `launcher_request`: stop the launcher here
        raise _Asked(LookupRequest(op, dtype, dict(shape), device))
    prefix = _prefix(op, dtype, device)
    exact, bucket = _exact_key(prefix, shape), _bucket_key(prefix, shape)
    entry = _user().get(exact) or _shipped().get(exact) or _user().get(bucket) or _shipped().get(bucket)
    return dict(entry["config"]) if entry else None


def store(
    op: str,
    dtype: torch.dtype,
    shape: dict[str, Any],
    config: dict,
    meta: dict | None = None,
    path: Path | None = None,
    device: torch.device | None = None,
) -> str:
    """Record a tuned config (with optional metadata such as its time) in the user's cache, under the
    shape's exact key and its bucket's (the bucket's entry names the exact key it came from). Returns
    the exact key."""
    global _user_entries
    path = path or user_cache_path()
    prefix = _prefix(op, dtype, device)
    key, bucket = _exact_key(prefix, shape), _bucket_key(prefix, shape)
    with _locked(path):
        entries = _read(path)
        entries[key] = {"config": config, **(meta or {})}
        entries[bucket] = {**entries[key], "from": key}
        _write(path, entries)
    _user_entries = None
    return key


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for read-merge-write of `path`: without it two writers that read the
    same file each write back their own entry only, and one is lost. The lock is on a sidecar file,
    `<name>.lock`, which is never replaced (`path` itself is replaced by rename, so a lock held on it
    would be on an inode that the next writer no longer opens). Without fcntl: no lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(path.with_name(f"{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: Path, entries: dict[str, dict]) -> None:
    """Replace `path` at once (temp file and rename: a reader never sees a half-written file)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"version": 1, "entries": entries}, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def shipped_path(device: torch.device | None = None) -> Path:
    """Where the shipped cache for this device lives: kiln/ops/shipped_configs/<device-slug>.json."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return SHIPPED_DIR / f"{slug}.json"


def export(
    keys: list[str] | None = None, path: Path | None = None, device: torch.device | None = None
) -> Path:
    """Copy tuned entries from the user's cache into a shipped cache file (default `shipped_path`),
    merged with what that file already holds. `keys`: the entries to copy (default: every entry of
    this device). Returns the path written."""
    path = Path(path) if path is not None else shipped_path(device)
    user = _read(user_cache_path())
    if keys is None:
        prefix = f"{device_name(device)}|"
        keys = [key for key in user if key.startswith(prefix)]
    missing = [key for key in keys if key not in user]
    if missing:
        raise ValueError(f"kiln tune export: {len(missing)} key(s) not in {user_cache_path()}: {missing[0]}")
    # with each exact entry, the bucket entry made from it (one that a later shape took over stays)
    exact = set(keys)
    keys = list(keys) + [bucket for bucket, entry in user.items() if entry.get("from") in exact]
    with _locked(path):
        entries = _read(path)
        entries.update({key: user[key] for key in keys})
        _write(path, entries)
    _shipped.cache_clear()
    return path
