"""Differentiable kiln.jax.rms_norm, silu_and_mul and gelu_tanh_and_mul: jax.custom_vjp around the
generated entry points (kiln.ops.jax_bridge.jax_function), whose backward runs the Pallas kernels of
kiln.jax.backward_pallas where the forward is the Pallas TPU kernel, else XLA's autodiff of the XLA
forward (the TPU kernels would run in the TPU interpreter off a TPU: an rms_norm grad of [512, 1024]
took 24 ms against 0.5 ms on a CPU), so jax.grad never traces into a pallas_call.

Same signatures and results as the generated functions: rms_norm(x, weight, eps=1e-6, residual=None,
weight_offset=0.0, implementation=None) returns y, or (y, x + residual) with a residual (JAX arrays are
immutable: the new residual is returned); the gated ops take x [..., 2d] and return [..., d]. eps,
weight_offset and implementation are static (not differentiated). Gradients flow to x, weight and
residual; d(x + residual) adds to both x's and residual's gradients.
"""

from __future__ import annotations

import functools

import jax

from kiln.jax.backward_pallas import gated_backward_pallas, rms_norm_backward_pallas
from kiln.ops import all_ops
from kiln.ops.jax_bridge import jax_function
from kiln.ops.pallas_common import resolve

_rms_norm_forward = jax_function(all_ops()["rms_norm"])
_gated_forward = {name: jax_function(all_ops()[f"{name}_and_mul"]) for name in ("silu", "gelu_tanh")}


# ---- rms_norm ------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm(x, weight, eps, weight_offset, implementation):
    return _rms_norm_forward(x, weight, eps, None, weight_offset, implementation=implementation)


def _rms_norm_fwd(x, weight, eps, weight_offset, implementation):
    return _rms_norm(x, weight, eps, weight_offset, implementation), (x, weight)


def _pallas_tpu(op: str, implementation) -> bool:
    """Whether the forward ran the Pallas TPU kernel (then so does the backward)."""
    return resolve(op, implementation) == "pallas_tpu"


def _rms_norm_xla_vjp(x, weight, grad_y, eps, weight_offset):
    _, vjp = jax.vjp(
        lambda x, w: _rms_norm_forward(x, w, eps, None, weight_offset, implementation="xla"), x, weight
    )
    return vjp(grad_y)


def _rms_norm_bwd(eps, weight_offset, implementation, saved, grad_y):
    x, weight = saved
    if not _pallas_tpu("rms_norm", implementation):
        return _rms_norm_xla_vjp(x, weight, grad_y, eps, weight_offset)
    return rms_norm_backward_pallas(x, weight, grad_y, eps, weight_offset)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _add_rms_norm(x, residual, weight, eps, weight_offset, implementation):
    return _rms_norm_forward(x, weight, eps, residual, weight_offset, implementation=implementation)


def _add_rms_norm_fwd(x, residual, weight, eps, weight_offset, implementation):
    y, s = _add_rms_norm(x, residual, weight, eps, weight_offset, implementation)
    return (y, s), (s, weight)


def _add_rms_norm_bwd(eps, weight_offset, implementation, saved, grads):
    s, weight = saved
    grad_y, grad_s = grads
    if not _pallas_tpu("rms_norm", implementation):
        ds, dw = _rms_norm_xla_vjp(s, weight, grad_y, eps, weight_offset)
    else:
        ds, dw = rms_norm_backward_pallas(s, weight, grad_y, eps, weight_offset)
    ds = ds + grad_s.astype(ds.dtype)
    return ds, ds, dw


_add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd)


def rms_norm(x, weight, eps: float = 1e-6, residual=None, weight_offset: float = 0.0, implementation=None):
    """RMSNorm of x [..., H] with weight [H] (see kiln.ops.rms_norm), differentiable in x, weight and
    residual: y, or (y, x + residual) with a residual. Backward: the Pallas kernel behind pallas_tpu,
    else XLA's autodiff."""
    if residual is None:
        return _rms_norm(x, weight, float(eps), float(weight_offset), implementation)
    return _add_rms_norm(x, residual, weight, float(eps), float(weight_offset), implementation)


# ---- gated activations ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gated(x, activation, implementation):
    return _gated_forward[activation](x, implementation=implementation)


def _gated_fwd(x, activation, implementation):
    return _gated(x, activation, implementation), x


def _gated_bwd(activation, implementation, x, grad_y):
    if not _pallas_tpu(f"{activation}_and_mul", implementation):
        _, vjp = jax.vjp(lambda x: _gated_forward[activation](x, implementation="xla"), x)
        return vjp(grad_y)
    return (gated_backward_pallas(x, grad_y, activation),)


_gated.defvjp(_gated_fwd, _gated_bwd)


def silu_and_mul(x, implementation=None):
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d], differentiable (Pallas backward behind pallas_tpu)."""
    return _gated(x, "silu", implementation)


def gelu_tanh_and_mul(x, implementation=None):
    """gelu_tanh(x[..., :d]) * x[..., d:] for x [..., 2d], differentiable (Pallas backward behind
    pallas_tpu)."""
    return _gated(x, "gelu_tanh", implementation)
