"""Measured device ceilings for the roofline: peak memory bandwidth and peak matmul throughput.

Measured, not looked up, once per device and cached as JSON in `$KILN_CEILINGS_CACHE` (default
~/.cache/kiln/ceilings.json), keyed by device name and torch version:
  - bandwidth: a large device-to-device copy (CPU: a large memcpy); bytes = read + written;
  - FLOP/s: a large matmul, bf16 and fp32 on CUDA (tensor cores vs not), fp32 on CPU.
The best sample is kept (a ceiling is the most the device has been seen to do).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Ceilings:
    """device_name: what the numbers belong to. bandwidth_gbs: GB/s (1e9 bytes, read + write).
    matmul_tflops: dtype name -> TFLOP/s (1e12)."""

    device_name: str
    bandwidth_gbs: float
    matmul_tflops: dict[str, float] = field(default_factory=dict)
    method: str = ""
    measured_at: str = ""

    def peak_flops(self, dtype: torch.dtype | str | None = None) -> float:
        """FLOP/s ceiling for an op of this dtype. float32 takes the faster of strict fp32 and TF32
        (Triton's fp32 `tl.dot` uses TF32 by default); float16 takes bf16's; fp8 and int8 their own
        numbers when measured (int8 else fp8's or bf16's); anything else (or None) the fastest measured."""
        name = str(dtype).replace("torch.", "") if dtype is not None else None
        measured = self.matmul_tflops
        if name == "float32" and "tfloat32" in measured:
            return max(measured.get("float32", 0.0), measured["tfloat32"]) * 1e12
        if name in ("float8_e4m3fn", "float8_e5m2") and "float8_e4m3fn" in measured:
            return measured["float8_e4m3fn"] * 1e12
        if name == "int8" and "int8" not in measured:  # Hopper's int8 units run at its fp8 rate
            name = "float8_e4m3fn" if "float8_e4m3fn" in measured else "bfloat16"
        if name in measured:
            return measured[name] * 1e12
        if name in ("float16", "float8_e4m3fn", "float8_e5m2") and "bfloat16" in measured:
            return measured["bfloat16"] * 1e12
        return max(measured.values()) * 1e12

    @property
    def peak_bandwidth(self) -> float:
        """Bytes per second."""
        return self.bandwidth_gbs * 1e9


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {name or platform.machine()} x{os.cpu_count()}"


def cache_path() -> Path:
    return Path(os.environ.get("KILN_CEILINGS_CACHE", Path.home() / ".cache" / "kiln" / "ceilings.json"))


def _cache_key(device: torch.device) -> str:
    return f"{device_name(device)}|torch-{torch.__version__}"


def load_cached(device: torch.device) -> Ceilings | None:
    try:
        entry = json.loads(cache_path().read_text()).get(_cache_key(device))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return Ceilings(**entry) if entry else None


def save_cached(device: torch.device, ceilings: Ceilings) -> None:
    path = cache_path()
    try:
        entries = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        entries = {}
    entries[_cache_key(device)] = asdict(ceilings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
    tmp.replace(path)


def measure_ceilings(device: torch.device | str, refresh: bool = False) -> Ceilings:
    """The device's ceilings: from the cache, else measured now (about a second) and cached."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not refresh:
        cached = load_cached(device)
        if cached is not None:
            return cached
    if device.type == "cuda":
        ceilings = _measure_cuda(device)
    else:
        ceilings = _measure_cpu(device)
    save_cached(device, ceilings)
    return ceilings


def _best_seconds(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up (allocator, cuBLAS heuristics, page faults)
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _measure_cuda(device: torch.device) -> Ceilings:
    with torch.cuda.device(device):
        n_bytes = 1 << 30  # 1 GiB each way: far past L2, long enough for events to be exact
        src = torch.empty(n_bytes, dtype=torch.uint8, device=device).random_()
        dst = torch.empty_like(src)
        seconds = _best_seconds(lambda d=dst, s=src: d.copy_(s), device, reps=10)
        bandwidth = 2 * n_bytes / seconds / 1e9
        del src, dst
        tflops = {}
        n = 8192
        previous_tf32 = torch.backends.cuda.matmul.allow_tf32
        try:
            for name, dtype, tf32 in (
                ("bfloat16", torch.bfloat16, False),
                ("float32", torch.float32, False),
                ("tfloat32", torch.float32, True),
            ):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                a = torch.randn(n, n, device=device, dtype=dtype)
                b = torch.randn(n, n, device=device, dtype=dtype)
                seconds = _best_seconds(lambda a=a, b=b: torch.mm(a, b), device, reps=10)
                tflops[name] = 2 * n**3 / seconds / 1e12
                del a, b
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous_tf32
        fp8 = _fp8_tflops(device, n)
        if fp8:
            tflops["float8_e4m3fn"] = fp8
        int8 = _int8_tops(device, n)
        if int8:
            tflops["int8"] = int8
        torch.cuda.empty_cache()
    return Ceilings(
        device_name(device),
        bandwidth,
        tflops,
        "1 GiB device-to-device copy; 8192^3 torch.mm in bf16, fp32, tf32 (fp8 _scaled_mm, int8 _int_mm); "
        "best of 10",
        _stamp(),
    )


def _fp8_tflops(device: torch.device, n: int) -> float | None:
    """fp8 (e4m3) GEMM throughput through torch._scaled_mm, or None where the GPU or torch lacks it."""
    if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    try:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
        one = torch.ones((), device=device)
        seconds = _best_seconds(
            lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), device, 10
        )
    except (RuntimeError, TypeError):  # unsupported on this build: the roofline uses bf16 for fp8
        return None
    return 2 * n**3 / seconds / 1e12


def _int8_tops(device: torch.device, n: int) -> float | None:
    """int8 GEMM throughput (int32 accumulation) through torch._int_mm, or None where it is missing."""
    if not hasattr(torch, "_int_mm"):
        return None
    try:
        a = torch.randint(-128, 128, (n, n), device=device, dtype=torch.int8)
        # column-major, as cuBLASLt's int8 kernels want (a row-major b measured ~126 TOPS on an H200,
        # and Kiln's int8_linear then ran at "745 % of roofline")
        b = torch.randint(-128, 128, (n, n), device=device, dtype=torch.int8).t()
        seconds = _best_seconds(lambda: torch._int_mm(a, b), device, 10)
    except (RuntimeError, TypeError):
        return None
    return 2 * n**3 / seconds / 1e12


def _measure_cpu(device: torch.device) -> Ceilings:
    n_bytes = 256 * 2**20
    src = torch.empty(n_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, reps=3)
    bandwidth = 2 * n_bytes / seconds / 1e9
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = _best_seconds(lambda: torch.mm(a, b), device, reps=3)
    return Ceilings(
        device_name(device),
        bandwidth,
        {"float32": 2 * n**3 / seconds / 1e12},
        "256 MiB memcpy; 1024^3 fp32 torch.mm; best of 3",
        _stamp(),
    )
