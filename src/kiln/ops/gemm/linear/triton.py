"""Triton dense GEMM: `linear` (bias epilogue), and the kernel `linear_silu_mul` runs (SILU_MUL).

One program owns a BLOCK_M x BLOCK_N output tile (grouped order, see ../tiling.py) and one K split.
Per BLOCK_K step it loads an x tile [BLOCK_M, BLOCK_K] and the weight tile [BLOCK_K, BLOCK_N] read
straight from W's [N, K] rows (no transpose copy), and accumulates in float32. For
linear_silu_mul the same program also loads the up rows (N + n) of the same output columns, so the
epilogue has gate and up for identical (m, n) and writes silu(gate) * up: the [M, 2N] intermediate
never reaches memory. fp32 operands use IEEE fp32 dots (torch's default semantics, not TF32).

On Hopper (compute capability >= 9) `linear_triton` (and linear_silu_mul's) run the TMA variant of
this kernel (triton_tma.py) when x and W are TMA-eligible, else this pointer kernel;
`KILN_GEMM_TMA=0` forces the pointer kernel. A TMA kernel that fails to build falls back to the
pointer kernel for the rest of the process, recorded in `kiln.fallbacks`. Both are registered here:
"triton" (that dispatch) and "triton_tma" (the TMA kernel wherever descriptors run, the pointer
kernel for layouts TMA rejects); `kiln bench` also times the pointer kernel alone as the
"triton_pointer" baseline.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from kiln import fallbacks
from kiln.ops.alloc import empty
from kiln.ops.checks import as_rows
from kiln.ops.gemm.linear.spec import LINEAR
from kiln.ops.gemm.linear.triton_tma import launch_linear_tma, tma_device, tma_eligible, use_tma
from kiln.ops.gemm.tiling import (
    config_space,
    launch_grid,
    nothing_to_multiply,
    partials_buffer,
    reduce_split_k,
    resolve_config,
    store_linear_tile,
    tile_options,
    tile_program,
)
from kiln.ops.registry import Implementation, triton_available

logger = logging.getLogger(__name__)


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
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
    offs_m, offs_n, m_mask, n_mask, pid_k, k_start, k_end = tile_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K
    )
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(w_cols + offs_k[:, None] * stride_wk, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if SILU_MUL:
            b_up = tl.load(w_cols + N * stride_wn + offs_k[:, None] * stride_wk, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
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


_TMA_FAILED: list[str] = []  # why the automatic TMA path was given up, if it was


def launch_dense(op: str, x, weight, bias, silu_mul: bool, config, kernel: str = "auto"):
    """x [..., K] @ weight [N or 2N, K]^T (+ bias) -> [..., N], with the SiLU-and-mul epilogue when
    `silu_mul`. kernel: "auto" (triton_tma.use_tma decides), "tma" (TMA whenever eligible) or
    "pointer"."""
    K = x.shape[-1]
    x2 = as_rows(x)
    M = x2.shape[0]
    N = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = empty((M, N), x.dtype, x.device)
    if (done := nothing_to_multiply(out, x.shape, bias)) is not None:
        return done
    shape = {"M": M, "N": N, "K": K} if silu_mul else {"M": M, "N": N, "K": K, "bias": bias is not None}
    cfg = resolve_config(op, x.dtype, shape, config, x.device, wide_operands=x.dtype == torch.float32)
    partials = partials_buffer(cfg, M, 2 * N if silu_mul else N, x.device)
    bias = bias.contiguous() if bias is not None else None
    if kernel == "tma":
        tma = tma_eligible(x2, weight)
    else:
        tma = kernel == "auto" and not _TMA_FAILED and use_tma(x2, weight)
    if tma:
        try:
            launch_linear_tma(x2, weight, bias, out, partials, cfg, silu_mul)
        except Exception as exc:  # a Triton that cannot build the TMA kernel: keep serving on pointers
            if kernel == "tma":
                raise
            _TMA_FAILED.append(repr(exc))
            fallbacks.record(fallbacks.GEMM_TMA_TO_POINTER, repr(exc))
            logger.warning("dense GEMM: TMA kernel failed (%r); using the pointer kernel from now on", exc)
            tma = False
    if not tma:
        _launch_pointer(x2, weight, bias, out, partials, cfg, silu_mul)
    reduce_split_k(partials, out, bias, silu_mul)
    return out.reshape(*x.shape[:-1], N)


def _launch_pointer(x2, weight, bias, out, partials, cfg, silu_mul: bool) -> None:
    M, K = x2.shape
    N = out.shape[1]
    bias_arg = bias if bias is not None else out
    _linear_kernel[launch_grid(cfg, M, N)](
        x2,
        weight,
        bias_arg,
        out,
        partials if partials is not None else out,
        M,
        N,
        K,
        x2.stride(0),
        x2.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        **tile_options(cfg),
    )


def linear_triton(x, weight, bias=None, config: dict | None = None):
    """`linear`: x `[..., K]`, weight `[N, K]`, bias `[N]` -> `[..., N]`; TMA kernel on Hopper."""
    return launch_dense("linear", x, weight, bias, False, config)


def linear_tma_triton(x, weight, bias=None, config: dict | None = None):
    """`linear` through the TMA kernel whenever x and weight are TMA-eligible (else the pointer one)."""
    return launch_dense("linear", x, weight, bias, False, config, kernel="tma")


def linear_pointer_triton(x, weight, bias=None, config: dict | None = None):
    """`linear` through the pointer kernel only (the fallback; a bench baseline on Hopper)."""
    return launch_dense("linear", x, weight, bias, False, config, kernel="pointer")


LINEAR.register(
    Implementation(
        "triton",
        linear_triton,
        triton_available,
        configs=config_space,
        description="tiled, grouped order, split-K for small M, bias epilogue",
    )
)
LINEAR.register(
    Implementation(
        "triton_tma",
        linear_tma_triton,
        tma_device,
        configs=config_space,
        description="TMA descriptor loads (Hopper+), else the pointer kernel; same tiling and epilogues",
    )
)
# bf16 tl.dot is wrong in the Triton interpreter, for this kernel as for the pointer one.
LINEAR.gpu_only_dtypes.setdefault("triton_tma", (torch.bfloat16,))
# On Hopper "triton" runs the TMA kernel: the pointer kernel alone is timed beside it and cuBLAS.
LINEAR.baselines.setdefault("triton_pointer", linear_pointer_triton)
