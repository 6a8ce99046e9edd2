"""linear as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU); linear_silu_mul and
w8a16_linear run the same kernel with their epilogues (see xla.py for the math).

Grid (M / block_m, N / block_n); each program loops over K in block_k steps (fori_loop over pl.ds
slices of its row panels) with a float32 register accumulator. Blocks are powers of two (Triton's
rule); M, N, K are zero-padded to them and the result sliced. With silu_mul the [2N, K] weight is
viewed as [2, N, K] and the program holds the gate and the up panel of the same output columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.linear.spec import LINEAR
from kiln.ops.gemm.linear.xla import dot_weight_rows, gemm_precision, over_rows
from kiln.ops.pallas_common import gpu_interpret, gpu_output_tiles_call, pad_to, round_up, squeezed


def _kernel(*refs, has_scale: bool, has_bias: bool, silu_mul: bool, block_k: int, num_k: int):
    refs = list(refs)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    up_ref = refs.pop(0) if silu_mul else None
    scale_ref = refs.pop(0) if has_scale else None
    bias_ref = refs.pop(0) if has_bias else None
    (o_ref,) = refs

    def body(kk, accs):
        start = pl.multiple_of(kk * block_k, block_k)
        x = x_ref[:, pl.ds(start, block_k)]
        precision = gemm_precision(x.dtype)  # IEEE fp32 for fp32 inputs, not TF32
        acc = accs[0] + dot_weight_rows(x, w_ref[:, pl.ds(start, block_k)], precision)
        if not silu_mul:
            return (acc,)
        return acc, accs[1] + dot_weight_rows(x, up_ref[:, pl.ds(start, block_k)], precision)

    zeros = jnp.zeros(o_ref.shape, jnp.float32)
    accs = jax.lax.fori_loop(0, num_k, body, (zeros, zeros) if silu_mul else (zeros,))
    acc = accs[0]
    if has_scale:
        acc = acc * scale_ref[...][None, :]
    if has_bias:
        acc = acc + bias_ref[...][None, :].astype(jnp.float32)
    if silu_mul:
        acc = acc * jax.nn.sigmoid(acc) * accs[1]
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("silu_mul", "blocks", "interpret"))
def gemm_gpu(x, w, scale, bias, silu_mul: bool, blocks, interpret):
    """x [M, K] @ w [N or 2N, K]^T with xla.py's epilogues -> [M, N] in x's dtype."""

    (m, k), n = x.shape, w.shape[0] // 2 if silu_mul else w.shape[0]
    block_m, block_n, block_k = blocks or (
        min(64, max(16, pl.next_power_of_2(m))),
        min(128, max(16, pl.next_power_of_2(n))),
        min(64, max(16, pl.next_power_of_2(k))),
    )
    mp, np_, kp = round_up(m, block_m), round_up(n, block_n), round_up(k, block_k)
    operands = [pad_to(pad_to(x, 0, mp), 1, kp)]
    # Row panels of x and w; the kernel loads block_k slices of them.
    in_specs = [pl.BlockSpec((block_m, kp), lambda i, j: (i, 0))]
    if silu_mul:  # [2, N, K]: the gate panel from half 0, the up panel of the same columns from half 1
        halves = pad_to(pad_to(w.reshape(2, n, k), 1, np_), 2, kp)
        operands += [halves, halves]
        in_specs += [
            pl.BlockSpec((squeezed(), block_n, kp), lambda i, j: (0, j, 0)),
            pl.BlockSpec((squeezed(), block_n, kp), lambda i, j: (1, j, 0)),
        ]
    else:
        operands.append(pad_to(pad_to(w, 0, np_), 1, kp))
        in_specs.append(pl.BlockSpec((block_n, kp), lambda i, j: (j, 0)))
    if scale is not None:  # bias, when given, follows as the last operand (gpu_output_tiles_call)
        operands.append(pad_to(scale, 0, np_))
        in_specs.append(pl.BlockSpec((block_n,), lambda i, j: (j,)))
    kernel = functools.partial(
        _kernel,
        has_scale=scale is not None,
        has_bias=bias is not None,
        silu_mul=silu_mul,
        block_k=block_k,
        num_k=kp // block_k,
    )
    return gpu_output_tiles_call(
        kernel, operands, in_specs, x.dtype, m, n, block_m, block_n, bias=bias, num_stages=3,
        interpret=interpret,
    )  # fmt: skip


def linear_pallas_gpu(x, weight, bias=None, *, blocks: tuple[int, int, int] | None = None, interpret=None):
    """x [..., K] @ weight[N, K]^T (+ bias [N]); the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret

    def kernel(x2):
        return gemm_gpu(x2, weight, None, bias, silu_mul=False, blocks=blocks, interpret=interpret)

    return over_rows(kernel, x, weight.shape[0], bias)


LINEAR.register_jax("pallas_gpu", linear_pallas_gpu)
