"""Liger-Kernel's training kernels as `kiln bench --backward` baselines, where it has the op and can run.

Liger-Kernel (the `liger_kernel` package) ships Triton kernels with their own backwards for the ops
below; its functional API (liger_kernel.transformers.functional) is called with the spec's inputs
(the same names as kiln.bench.backward_baselines). Its kernels are GPU-only, so the baseline runs
only when the package imports and the device is CUDA; otherwise the JSON records why it was not run
({"skipped": "liger_kernel not installed"} or {"skipped": "needs CUDA ..."}).

rms_norm: liger_rms_norm / liger_fused_add_rms_norm (with a residual; returns (y, x + residual)),
    in_place=False (its in-place backward would overwrite the reused upstream gradient);
silu_and_mul / gelu_tanh_and_mul: liger_swiglu / liger_geglu (tanh GELU) on the two halves;
layer_norm: liger_layer_norm (a zero bias when the case has none);
fused_linear_cross_entropy: liger_fused_linear_cross_entropy (z_loss as lse_square_scale).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch

NAME = "liger_kernel"


def _halves(x):
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def _rms_norm(F, x, weight, eps=1e-6, residual=None, weight_offset=0.0):
    if residual is None:
        return (F.liger_rms_norm(x, weight, eps, weight_offset, in_place=False),)
    y, s = F.liger_fused_add_rms_norm(x, residual, weight, eps, weight_offset, in_place=False)
    return y, s


def _layer_norm(F, x, weight, bias=None, eps=1e-5):
    bias = torch.zeros_like(weight) if bias is None else bias
    return (F.liger_layer_norm(x, weight, bias, eps),)


def _fused_linear_cross_entropy(
    F, hidden, weight, labels, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean"
):
    loss = F.liger_fused_linear_cross_entropy(
        hidden, weight, labels, bias, ignore_index=ignore_index, lse_square_scale=z_loss,
        label_smoothing=label_smoothing, reduction=reduction,
    )  # fmt: skip
    return (loss,)


# op -> (functions of liger_kernel.transformers.functional it needs, forward(F, **inputs) -> outputs)
FORWARDS: dict[str, tuple[tuple[str, ...], Callable]] = {
    "rms_norm": (("liger_rms_norm", "liger_fused_add_rms_norm"), _rms_norm),
    "layer_norm": (("liger_layer_norm",), _layer_norm),
    "silu_and_mul": (("liger_swiglu",), lambda F, x, **_: (F.liger_swiglu(*_halves(x)),)),
    "gelu_tanh_and_mul": (("liger_geglu",), lambda F, x, **_: (F.liger_geglu(*_halves(x)),)),
    "fused_linear_cross_entropy": (("liger_fused_linear_cross_entropy",), _fused_linear_cross_entropy),
}


def liger_baselines(op: str, device: torch.device) -> tuple[dict[str, Callable], dict[str, str]]:
    """({"liger_kernel": forward(**inputs) -> outputs} when it can run, {"liger_kernel": why not}
    otherwise); both empty for an op Liger-Kernel does not have."""
    if op not in FORWARDS:
        return {}, {}
    if importlib.util.find_spec(NAME) is None:
        return {}, {NAME: "liger_kernel not installed"}
    if device.type != "cuda":
        return {}, {
            NAME: f"needs CUDA (liger_kernel's kernels are GPU Triton kernels; device is {device.type})"
        }
    try:
        functional = importlib.import_module("liger_kernel.transformers.functional")
    except Exception as exc:  # a broken install is reported, not raised
        return {}, {NAME: f"liger_kernel does not import: {type(exc).__name__}: {exc}"}
    needed, forward = FORWARDS[op]
    missing = [name for name in needed if not hasattr(functional, name)]
    if missing:
        return {}, {NAME: f"this liger_kernel version lacks {', '.join(missing)}"}
    return {NAME: lambda **inputs: forward(functional, **inputs)}, {}
