"""Tiling shared by every GEMM kernel in this family: grouped tile order, split-K partials and their
reduction, and the launch configs (tuning space + heuristic default).

Every GEMM kernel here computes `out[M, N] = x[M, K] @ W[N, K]^T` with one program per
(BLOCK_M x BLOCK_N) output tile and K-slice. Programs are numbered in "grouped" order: GROUP_M tile
rows are walked column by column, so the programs running at the same time share W column tiles
and x row tiles in L2 instead of streaming all of W once per tile row.

Split-K (for small M, where there are too few output tiles to fill the GPU): the K loop is cut into
SPLIT_K slices, program (tile, k) writes its float32 partial sum into `partials[k, M, N_acc]`, and
`split_k_reduce_kernel` sums the slices and applies the epilogue (bias, or SiLU-and-mul when the
partials hold gate columns [0, N) and up columns [N, 2N)). Scales of the quantized GEMMs are applied
per slice before the partial is written (they are linear, so summing afterwards is exact).

Config dict keys: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, num_warps, num_stages.
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.tuned_configs import lookup

CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages")


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` in grouped (super-tile) order."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def k_range(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[k_start, k_end) of split `pid_k`: whole BLOCK_K steps, the last split may be short or empty."""
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    return k_start, k_end


@triton.jit
def tile_program(
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """What this program of a `launch_grid` launch owns: its output rows and columns (with their
    bounds masks), its K split pid_k and that split's [k_start, k_end)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    k_start, k_end = k_range(pid_k, K, BLOCK_K, SPLIT_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N, pid_k, k_start, k_end


@triton.jit
def store_tile(
    acc,
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
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Epilogue of a float32 tile: with one K split add the bias and store in out's dtype; with
    several, store the partial into its slab of `partials [SPLIT_K, M, N]` (the reduce adds bias)."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        rows = offs_m[:, None].to(tl.int64)  # M * N may pass 2^31 (a long prefill times a wide layer)
        ptrs = out_ptr + rows * stride_om + offs_n[None, :] * stride_on
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        slab = partial_ptr + pid_k.to(tl.int64) * M * N
        tl.store(slab + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def store_linear_tile(
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
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Epilogue of the dense GEMM kernels. Plain: `store_tile(acc)`. SILU_MUL (acc = gate, acc_up =
    up): with one K split, store silu(gate) * up; with several, store gate into columns [0, N) and up
    into [N, 2N) of this split's slab of `partials [SPLIT_K, M, 2N]` (the reduction finishes it)."""
    if SILU_MUL and SPLIT_K > 1:
        rows = offs_m[:, None].to(tl.int64)
        slab = partial_ptr + pid_k.to(tl.int64) * M * 2 * N + rows * 2 * N + offs_n[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(slab, acc, mask=mask)
        tl.store(slab + N, acc_up, mask=mask)
    else:
        if SILU_MUL:
            acc = acc * tl.sigmoid(acc) * acc_up
        store_tile(acc, out_ptr, bias_ptr, partial_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
                   HAS_BIAS, SPLIT_K)  # fmt: skip


@triton.jit
def split_k_reduce_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    stride_on,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Sum the SPLIT_K float32 partials of one output tile, then the epilogue. With SILU_MUL the
    partials are [SPLIT_K, M, 2N] (gate columns first) and the output is silu(gate) * up."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    n_acc = 2 * N if SILU_MUL else N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(SPLIT_K):
        slab = partial_ptr + k * M * n_acc + offs_m[:, None] * n_acc + offs_n[None, :]
        acc += tl.load(slab, mask=mask, other=0.0)
        if SILU_MUL:
            up += tl.load(slab + N, mask=mask, other=0.0)
    if SILU_MUL:
        acc = acc * tl.sigmoid(acc) * up
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def partials_buffer(config: dict, M: int, n_acc: int, device: torch.device) -> torch.Tensor | None:
    """The float32 split-K slabs [SPLIT_K, M, n_acc], or None without split-K."""
    if config["SPLIT_K"] == 1:
        return None
    return empty((config["SPLIT_K"], M, n_acc), torch.float32, device)


def reduce_split_k(
    partials: torch.Tensor | None, out: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False
) -> None:
    """Second pass of a split-K GEMM: sums the partials into `out` (no-op without split-K), adding bias
    [N] (any strides: the kernel reads it contiguous)."""
    if partials is None:
        return
    M, N = out.shape
    grid = (triton.cdiv(M, 32), triton.cdiv(N, 64))
    split_k_reduce_kernel[grid](
        partials,
        bias.contiguous() if bias is not None else out,
        out,
        M,
        N,
        out.stride(0),
        out.stride(1),
        SPLIT_K=partials.shape[0],
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        BLOCK_M=32,
        BLOCK_N=64,
    )


def nothing_to_multiply(
    out: torch.Tensor, x_shape: torch.Size, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """The result [..., N] of a GEMM into out [M, N] (x [..., K]) that has no product to launch: out as
    it is when M or N is 0, zeros (+ bias) when K is 0 (an empty sum, as torch's matmul gives); None
    when there is work."""
    (M, N), K = out.shape, x_shape[-1]
    if M and N and K:
        return None
    if M and N:
        out.zero_()
        if bias is not None:
            out += bias
    return out.reshape(*x_shape[:-1], N)


def launch_grid(config: dict, M: int, N: int) -> tuple[int, int]:
    return (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"]), config["SPLIT_K"])


def kernel_options(config: dict) -> dict:
    return {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}


def tile_options(config: dict) -> dict:
    """The launch keywords of a `tile_program` kernel: its block sizes, GROUP_M, SPLIT_K, warps, stages."""
    return {key: config[key] for key in CONFIG_KEYS}


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 8  # interpreter: small, so split-K still runs on the CPU-sized test shapes


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pow2_at_least(n: int, low: int) -> int:
    return max(low, triton.next_power_of_2(max(n, 1)))


def heuristic_config(
    M: int,
    N: int,
    K: int,
    device: torch.device,
    min_block_k: int = 16,
    wide_operands: bool = False,
    max_block_k: int | None = None,
    byte_operands: bool = False,
) -> dict:
    """A good default without tuning. Large M: 128x128 tiles (64 along K; 32 for fp32 operands so
    the pipelined stages fit in shared memory; 128 in 4 stages for 8-bit ones, the same bytes per
    stage), grouped by 8. Small M (decode): the thinnest tile tl.dot allows and split-K until there are
    about two programs per SM."""
    if M <= 64:
        block_m = pow2_at_least(M, 16)
        block_n = 64
        block_k = 128 if not wide_operands else 64
        num_warps, num_stages = 4, 4
    elif byte_operands:  # fp8 / int8: at 64 deep the H200 ran fp8_linear at ~36 % of _scaled_mm (M=2048)
        block_m = 64 if M <= 256 else 128
        block_n = 128
        block_k = 128
        num_warps, num_stages = 8, 4
    else:
        block_m = 64 if M <= 256 else 128
        block_n = 128
        block_k = 32 if wide_operands else 64
        num_warps, num_stages = 8, 3
    # Never wider than the problem (matters for the interpreter and for tiny layers).
    block_n = min(block_n, pow2_at_least(N, 16))
    block_k = max(min(block_k, pow2_at_least(K, 16), max_block_k or block_k), min_block_k)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    programs = 2 * num_sms(device) if M <= 64 else 0
    split_k = split_k_to_fill(tiles, triton.cdiv(K, block_k), programs)
    return tile_config(block_m, block_n, block_k, split_k, num_warps, num_stages)


def split_k_to_fill(tiles: int, k_steps: int, programs: int) -> int:
    """The K split of a launch of `tiles` output tiles: the largest power of two keeping tiles * split
    within `programs` (e.g. two per SM), at most 16 and at most the K steps; 1 when programs <= tiles."""
    split_k = 1
    while tiles * split_k * 2 <= programs and split_k * 2 <= min(k_steps, 16):
        split_k *= 2
    return split_k


def tile_config(
    block_m: int, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int
) -> dict:
    """A `tile_program` launch's config dict (CONFIG_KEYS; programs grouped by 8 along M)."""
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "GROUP_M": 8,
        "SPLIT_K": split_k,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }


SHARED_MEMORY_BUDGET = 200 * 1024  # below H100's 227 KiB per block, leaving room for the epilogue


def config_space(shape: dict, dtype: torch.dtype, min_block_k: int = 16, b_tiles: int = 1) -> list[dict]:
    """The `kiln tune` search space for a GEMM shape {"M", "N", "K", ...}: configs whose pipelined
    x and weight tiles (`b_tiles` weight tiles per step) fit in shared memory."""
    operand_bytes = 4 if dtype == torch.float32 else 2
    M, N, K = shape["M"], shape["N"], shape["K"]
    small = M <= 64
    block_ms = [16, 32, 64] if small else [64, 128]
    split_ks = [1, 2, 4, 8] if small else [1]
    configs = []
    for bm, bn, bk, sk, warps, stages in itertools.product(
        block_ms, [64, 128, 256], [32, 64, 128], split_ks, [4, 8], [3, 4]
    ):
        if bk < min_block_k or bm > pow2_at_least(M, 16) or bn > pow2_at_least(N, 16):
            continue
        if bk > pow2_at_least(K, 16) or (bm * bn >= 128 * 256 and warps == 4):
            continue
        if (bm * bk + b_tiles * bk * bn) * operand_bytes * stages > SHARED_MEMORY_BUDGET:
            continue
        configs.append(
            {
                "BLOCK_M": bm,
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "GROUP_M": 8,
                "SPLIT_K": sk,
                "num_warps": warps,
                "num_stages": stages,
            }
        )
    return configs


def resolve_config(
    op: str,
    dtype: torch.dtype,
    shape: dict,
    config: dict | None,
    device: torch.device,
    min_block_k: int = 16,
    wide_operands: bool = False,
    max_block_k: int | None = None,
    byte_operands: bool = False,
) -> dict:
    """The config a launcher uses: the caller's, else the tuning cache's, else the heuristic."""
    if config is None:
        config = lookup(op, dtype, shape, device)
    if config is None:
        return heuristic_config(
            shape["M"], shape["N"], shape["K"], device, min_block_k, wide_operands, max_block_k, byte_operands
        )
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(f"{op}: config {config} is missing {', '.join(missing)}")
    if config["BLOCK_K"] < min_block_k or config["BLOCK_K"] % min_block_k:
        raise ValueError(f"{op}: config BLOCK_K={config['BLOCK_K']} must be a multiple of {min_block_k}")
    if min(config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]) < 16:
        raise ValueError(f"{op}: config blocks must be >= 16 (tl.dot), got {config}")
    return dict(config)
