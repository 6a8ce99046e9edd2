"""What `kiln verify --grad` differentiates: one `GradOp` per op with a registered backward.

A GradOp borrows the op's spec for inputs (`make_inputs`) and fuzz shapes, and says
  - `wrt`: which inputs have a gradient (those present in a case: an absent bias has none);
  - `forward`: the differentiable Kiln call (kiln.ops.autograd) -> the tuple of outputs the gradient
    flows from;
  - `reference`: the same outputs from the op's float64 definition, written with differentiable torch
    (the spec's reference where it is one, a short autograd twin where the spec's is not);
  - `tolerance`: the bound on ||grad - grad_ref|| / ||grad_ref|| per input dtype.
Tolerances: float32 is the forward's (summation order only). In halves the inputs are the same
rounded values on both sides; each gradient is rounded once to the input dtype (2^-11 fp16, 2^-8
bf16), and where the backward reads the forward's rounded output (softmax's y, attention's out via
delta = rowsum(dO * O)) that rounding enters too, so those ops get the spec's forward bound doubled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln.ops import all_ops
from kiln.ops import autograd as ka

HALF_ONE_ROUNDING = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HALF_TWO_ROUNDINGS = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class GradOp:
    """One differentiable op as the gradient verifier sees it (see the module docstring)."""

    name: str
    wrt: tuple[str, ...]
    forward: Callable[[dict], tuple[torch.Tensor, ...]]
    reference: Callable[[dict], tuple[torch.Tensor, ...]]
    tolerance: dict[torch.dtype, float]
    # other specs whose gpu_only_dtypes also apply (the backward's own op, e.g. flash_attention_backward)
    also_gpu_only: tuple[str, ...] = field(default_factory=tuple)
    # shape -> why its gradient cannot be checked by relative error ("" = it can): see _norm_degenerate
    excluded: Callable[[dict], str] = lambda shape: ""

    @property
    def spec(self):
        return all_ops()[self.name]

    def inputs_with_grad(self, inputs: dict) -> list[str]:
        return [name for name in self.wrt if inputs.get(name) is not None]


def _tuple(value) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _spec_reference(name: str, mutated: tuple[str, ...] = ()):
    """The spec's reference, called on clones of the arguments it writes in place (a leaf that needs
    a gradient cannot be written; its clone can, and autograd follows the write)."""

    def reference(inputs: dict) -> tuple[torch.Tensor, ...]:
        args = {k: (v.clone() if k in mutated and v is not None else v) for k, v in inputs.items()}
        return _tuple(all_ops()[name].reference(**args))

    return reference


def _norm_degenerate(min_hidden: int) -> Callable[[dict], str]:
    """Norms over fewer than `min_hidden` values, whose x gradient is cancellation: RMSNorm of one
    value is sign(x) * w up to eps (d y / d x = w eps / (x^2 + eps)^1.5, a difference of two nearly
    equal float32 terms), LayerNorm of two values is +-1 likewise. No float32 computation resolves
    it: torch's own float32 autograd is off by 0.19 (rms_norm, hidden 1) and 6e-3 (layer_norm,
    hidden 2) against float64, against 3e-6 at hidden 3. Relative error would measure that, not the
    kernel; such fuzz shapes are reported as excluded."""

    def excluded(shape: dict) -> str:
        if shape["hidden"] < min_hidden:
            return f"hidden < {min_hidden}: the x gradient is float32 cancellation"
        return ""

    return excluded


def _rms_norm(i):
    return _tuple(ka.rms_norm(i["x"], i["weight"], i["eps"], i["residual"], i["weight_offset"]))


def _rotary(i):
    return ka.rotary_embedding(i["positions"], i["q"], i["k"], i["cos_sin_cache"], i["is_neox"])


def _fused_linear_cross_entropy(i):
    keys = ("hidden", "weight", "labels", "bias", "ignore_index", "label_smoothing", "z_loss", "reduction")
    return (ka.fused_linear_cross_entropy_loss(*(i[k] for k in keys)),)


def fused_linear_cross_entropy_loss_reference(
    hidden, weight, labels, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean"
):
    """The loss alone, differentiable (the spec's reference returns autograd's gradients, detached)."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    labels = labels.long()
    loss = torch.nn.functional.cross_entropy(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum"
    )
    valid = labels != ignore_index
    loss = loss + z_loss * logits.logsumexp(dim=-1)[valid].pow(2).sum()
    return loss / valid.sum() if reduction == "mean" else loss


def _flash_attention(i):
    keys = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    options = ("causal", "scale", "sliding_window", "softcap")
    return ka.flash_attention(*(i[k] for k in keys), *(i[k] for k in options), return_lse=True)


GRAD_OPS: dict[str, GradOp] = {
    op.name: op
    for op in (
        GradOp(
            "silu_and_mul",
            ("x",),
            lambda i: (ka.silu_and_mul(i["x"]),),
            _spec_reference("silu_and_mul"),
            HALF_ONE_ROUNDING,
        ),
        GradOp(
            "gelu_tanh_and_mul",
            ("x",),
            lambda i: (ka.gelu_tanh_and_mul(i["x"]),),
            _spec_reference("gelu_tanh_and_mul"),
            HALF_ONE_ROUNDING,
        ),
        GradOp(
            "rms_norm",
            ("x", "weight", "residual"),
            _rms_norm,
            _spec_reference("rms_norm", mutated=("residual",)),
            HALF_ONE_ROUNDING,
            excluded=_norm_degenerate(2),
        ),
        GradOp(
            "layer_norm",
            ("x", "weight", "bias"),
            lambda i: (ka.layer_norm(i["x"], i["weight"], i["bias"], i["eps"]),),
            _spec_reference("layer_norm"),
            HALF_ONE_ROUNDING,
            excluded=_norm_degenerate(3),
        ),
        GradOp(
            "softmax",
            ("x",),
            lambda i: (ka.softmax(i["x"], i["temperature"]),),
            _spec_reference("softmax"),
            HALF_TWO_ROUNDINGS,
        ),
        GradOp(
            "rotary_embedding",
            ("q", "k"),
            _rotary,
            _spec_reference("rotary_embedding", mutated=("q", "k")),
            HALF_ONE_ROUNDING,
        ),
        GradOp(
            "fused_linear_cross_entropy",
            ("hidden", "weight", "bias"),
            _fused_linear_cross_entropy,
            lambda i: (fused_linear_cross_entropy_loss_reference(**i),),
            # the spec's forward bound: grad_weight sums over chunks of tokens in float32
            {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2},
        ),
        GradOp(
            "flash_attention_with_lse",
            ("q", "k", "v"),
            _flash_attention,
            _spec_reference("flash_attention_with_lse"),
            HALF_TWO_ROUNDINGS,
            also_gpu_only=("flash_attention_backward",),
        ),
    )
}
