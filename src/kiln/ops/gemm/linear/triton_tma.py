"""Hopper TMA variant of the dense GEMM: `linear` and `linear_silu_mul` with tensor-descriptor loads.

Same math, tiling, split-K and epilogues as the pointer kernel in triton.py (y = x @ W^T (+ bias), or
silu(x @ Wg^T) * (x @ Wu^T) from a [2N, K] gate_up weight), but x [M, K] and W [N, K] are read
through host-side TMA descriptors: per BLOCK_K step the program asks the copy engine for the
[BLOCK_M, BLOCK_K] x tile at (row0, k0) and the [BLOCK_N, BLOCK_K] weight tile at (col0, k0) (the up
tile at (N + col0, k0)); the weight tile is used transposed (`.T`, a shared-memory view) in tl.dot.
TMA zero-fills rows and columns past the tensor's end, so the loads need no masks; a split's K range
is whole BLOCK_K steps (tiling.k_range), so no load crosses into a neighbouring split. Stores stay
pointer stores (masked, and split-K partials go through tiling's reduction).

TMA needs 16-byte aligned base pointers and row strides and unit stride along K (`tma_eligible`);
triton.py falls back to the pointer kernel otherwise, and registers this kernel's "triton_tma"
implementations there (its launcher picks between the two kernels). `KILN_GEMM_TMA` picks the path:
unset = the TMA kernel on CUDA devices of compute capability >= 9 (Hopper and newer) when eligible,
"0" = never, "1" = whenever eligible, the Triton interpreter included (how the CPU tests reach it).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kiln.ops.gemm.tiling import grouped_tile, k_range, launch_grid, store_linear_tile, tile_options
from kiln.ops.registry import triton_interpreting

try:  # host-side descriptors: triton >= 3.4 (the GPU image has 3.6)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

TMA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TMA_ALIGNMENT = 16  # bytes: TMA's rule for the base address and every non-unit stride


def descriptors_available() -> bool:
    """Whether the installed Triton has host-side tensor descriptors."""
    return TensorDescriptor is not None


@functools.cache
def _compute_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tma_device(device: torch.device | None) -> bool:
    """Whether the TMA kernel can run for tensors on `device` (None = anywhere at all): a CUDA
    device of compute capability >= 9, or any device under the Triton interpreter."""
    if not descriptors_available():
        return False
    if triton_interpreting() and (device is None or device.type != "cuda"):
        return True
    if device is None:
        return torch.cuda.is_available() and _compute_capability(torch.cuda.current_device())[0] >= 9
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _compute_capability(index)[0] >= 9


def tma_eligible(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x2 `[M, K]` and weight `[N or 2N, K]` can be read through TMA descriptors: a TMA
    device, fp16/bf16/fp32, unit stride along K, 16-byte aligned data pointers and row strides."""
    if not tma_device(x2.device) or x2.dtype not in TMA_DTYPES or weight.dtype != x2.dtype:
        return False
    for t in (x2, weight):
        if t.dim() != 2 or t.stride(1) != 1:
            return False
        if (t.stride(0) * t.element_size()) % TMA_ALIGNMENT or t.data_ptr() % TMA_ALIGNMENT:
            return False
    return True


def use_tma(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """The dense GEMM's dispatch between TMA and pointer kernels (see the module docstring)."""
    mode = os.environ.get("KILN_GEMM_TMA", "")
    if mode == "0" or not tma_eligible(x2, weight):
        return False
    return mode == "1" or x2.device.type == "cuda"


@triton.jit
def _linear_tma_kernel(
    x_desc,
    w_desc,
    bias_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    K,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    k_start, k_end = k_range(pid_k, K, BLOCK_K, SPLIT_K)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = x_desc.load([row0, k0])
        # Gate rows past N of a silu_mul weight are up rows: computed, then masked at the store.
        acc = tl.dot(a, w_desc.load([col0, k0]).T, acc, input_precision=DOT_PRECISION)
        if SILU_MUL:
            acc_up = tl.dot(a, w_desc.load([N + col0, k0]).T, acc_up, input_precision=DOT_PRECISION)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    store_linear_tile(
        acc,
        acc_up,
        out_ptr,
        bias_ptr,
        partial_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_om,
        stride_on,
        pid_k,
        HAS_BIAS,
        SILU_MUL,
        SPLIT_K,
    )


def launch_linear_tma(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    partials: torch.Tensor | None,
    config: dict,
    silu_mul: bool,
) -> None:
    """Run the TMA kernel into `out [M, N]` (or `partials [SPLIT_K, M, N or 2N]` with split-K, for
    tiling.reduce_split_k to finish). x2 `[M, K]` and weight `[N or 2N, K]` must be `tma_eligible`;
    M, N, K > 0; `config` resolved (its block sizes are the descriptors' block shapes)."""
    M, K = x2.shape
    N = out.shape[1]
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    x_desc = TensorDescriptor.from_tensor(x2, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    _linear_tma_kernel[launch_grid(config, M, N)](
        x_desc,
        w_desc,
        bias if bias is not None else out,
        out,
        partials if partials is not None else out,
        M,
        N,
        K,
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        **tile_options(config),
    )
