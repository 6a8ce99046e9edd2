"""Pallas kernels for RMSNorm (optionally fused with the residual add), on JAX arrays.

    x [rows, hidden] f32/f16/bf16, weight [hidden], residual [rows, hidden] | None
    s = x + residual (the new residual stream), y = s * rsqrt(mean(s^2) + eps) * weight

Statistics in float32. The mean divides by the true hidden size, so zero padding never changes it.
Three backends with one signature: `rms_norm_pallas_tpu` (Mosaic), `rms_norm_pallas_gpu` (Triton
lowering) and `rms_norm_xla` (plain jax.numpy, what XLA fuses by itself). They return y, or
(y, s) with the residual; `kiln.jax.rms_norm` validates arguments and picks one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.jax.dispatch import gpu_interpret, pad_to, round_up, row_block, squeezed, tpu_interpret, tpu_params


def _normalize(s, w, eps: float, hidden: int):
    """s, w float32; the padded columns of s are zero, so dividing by the true `hidden` is exact."""
    inv_rms = jax.lax.rsqrt(jnp.sum(s * s, axis=-1, keepdims=True) / hidden + eps)
    return s * inv_rms * w


# ---- TPU (Mosaic): a program owns `block_rows` full rows; the whole row is one block (last dim =
# the full hidden size, which Mosaic accepts), rows are padded to a multiple of block_rows.


def _tpu_kernel(*refs, eps: float, hidden: int, has_residual: bool):
    if has_residual:
        x_ref, r_ref, w_ref, y_ref, s_ref = refs
        s = x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)
        s_ref[...] = s.astype(s_ref.dtype)
    else:
        x_ref, w_ref, y_ref = refs
        s = x_ref[...].astype(jnp.float32)
    y_ref[...] = _normalize(s, w_ref[...].astype(jnp.float32), eps, hidden).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _rms_norm_tpu(x, weight, residual, eps, interpret):
    rows, hidden = x.shape
    block_rows = row_block(rows, hidden * 4 * (3 if residual is not None else 2), x.dtype)
    padded_rows = round_up(rows, block_rows)
    row_spec = pl.BlockSpec((block_rows, hidden), lambda i: (i, 0))
    operands = [pad_to(x, 0, padded_rows)]
    in_specs = [row_spec]
    if residual is not None:
        operands.append(pad_to(residual, 0, padded_rows))
        in_specs.append(row_spec)
    operands.append(weight.reshape(1, hidden))
    in_specs.append(pl.BlockSpec((1, hidden), lambda i: (0, 0)))
    out_shape = jax.ShapeDtypeStruct((padded_rows, hidden), x.dtype)
    outs = pl.pallas_call(
        functools.partial(_tpu_kernel, eps=eps, hidden=hidden, has_residual=residual is not None),
        out_shape=(out_shape, out_shape) if residual is not None else out_shape,
        grid=(padded_rows // block_rows,),
        in_specs=in_specs,
        out_specs=(row_spec, row_spec) if residual is not None else row_spec,
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(*operands)
    if residual is None:
        return outs[:rows]
    return outs[0][:rows], outs[1][:rows]


def rms_norm_pallas_tpu(x, weight, eps: float = 1e-6, residual=None, *, interpret=None):
    """x, residual [rows, hidden], weight [hidden]; the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    return _rms_norm_tpu(x, weight, residual, eps=float(eps), interpret=interpret)


# ---- GPU (Pallas Triton): one program per row. Triton blocks are powers of two, so the hidden
# dim is zero-padded to the next power of two.


def _gpu_kernel(*refs, eps: float, hidden: int, has_residual: bool):
    if has_residual:
        x_ref, r_ref, w_ref, y_ref, s_ref = refs
        s = x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)
        s_ref[...] = s.astype(s_ref.dtype)
    else:
        x_ref, w_ref, y_ref = refs
        s = x_ref[...].astype(jnp.float32)
    y_ref[...] = _normalize(s, w_ref[...].astype(jnp.float32), eps, hidden).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _rms_norm_gpu(x, weight, residual, eps, interpret):
    rows, hidden = x.shape
    block = pl.next_power_of_2(hidden)
    row_spec = pl.BlockSpec((squeezed(), block), lambda i: (i, 0))
    operands = [pad_to(x, 1, block)]
    in_specs = [row_spec]
    if residual is not None:
        operands.append(pad_to(residual, 1, block))
        in_specs.append(row_spec)
    operands.append(pad_to(weight, 0, block))
    in_specs.append(pl.BlockSpec((block,), lambda i: (0,)))
    out_shape = jax.ShapeDtypeStruct((rows, block), x.dtype)
    from jax.experimental.pallas import triton as plgpu

    outs = pl.pallas_call(
        functools.partial(_gpu_kernel, eps=eps, hidden=hidden, has_residual=residual is not None),
        out_shape=(out_shape, out_shape) if residual is not None else out_shape,
        grid=(rows,),
        in_specs=in_specs,
        out_specs=(row_spec, row_spec) if residual is not None else row_spec,
        compiler_params=plgpu.CompilerParams(num_warps=min(max(block // 256, 1), 16)),
        interpret=interpret,
    )(*operands)
    if residual is None:
        return outs[:, :hidden]
    return outs[0][:, :hidden], outs[1][:, :hidden]


def rms_norm_pallas_gpu(x, weight, eps: float = 1e-6, residual=None, *, interpret=None):
    """x, residual [rows, hidden], weight [hidden]; the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    return _rms_norm_gpu(x, weight, residual, eps=float(eps), interpret=interpret)


# ---- XLA: the same math in jax.numpy; XLA fuses it into one pass.


@functools.partial(jax.jit, static_argnames=("eps",))
def _rms_norm_xla(x, weight, residual, eps):
    s = x.astype(jnp.float32)
    if residual is not None:
        s = s + residual.astype(jnp.float32)
    y = _normalize(s, weight.astype(jnp.float32), eps, x.shape[-1]).astype(x.dtype)
    return y if residual is None else (y, s.astype(x.dtype))


def rms_norm_xla(x, weight, eps: float = 1e-6, residual=None):
    return _rms_norm_xla(x, weight, residual, eps=float(eps))
