"""fused_linear_cross_entropy: the LM head and the cross-entropy loss in one op, with its gradients,
computed over chunks of tokens so the [tokens, vocab] logits never exist at once.

    hidden:  [T, H]  float32 / float16 / bfloat16 (the last hidden states, one row per token)
    weight:  [V, H]  same dtype (the LM head, checkpoint layout: logits = hidden @ weight^T)
    labels:  [T]     int64 / int32, each in [0, V) or equal to ignore_index
    bias:    [V]     same dtype, or None
    For each token t with labels[t] != ignore_index (the "valid" tokens), with z = logits[t] and
    lse = logsumexp(z), eps = label_smoothing:
        loss_t = lse - (1 - eps) * z[y] - eps * mean(z) + z_loss * lse^2
    (label smoothing as torch.nn.functional.cross_entropy: the target mixes the one-hot label with
    the uniform distribution; z-loss as PaLM's auxiliary loss on the softmax normalizer).
    loss = sum over valid tokens ("sum") or that sum / number of valid tokens ("mean"; NaN when
    every token is ignored, as torch's cross_entropy).
    Returns (loss, grad_hidden, grad_weight, grad_bias): the float32 scalar loss (float64 for
    float64 inputs) and d loss / d hidden [T, H], d loss / d weight [V, H] (the inputs' dtypes),
    d loss / d bias [V] ([0] when bias is None). The gradients are computed in the same pass as the
    loss, chunk by chunk (Liger-Kernel's approach), so the backward pass only scales them by the
    incoming gradient: peak memory is one chunk of logits plus the gradients, never T x V.
    compute_grads=False (evaluation, nothing to differentiate): the loss alone, without the two
    gradient GEMMs per chunk; the three gradients come back empty ([0]).
Labels outside [0, V) that are not ignore_index give an undefined loss (validation reads shapes and
dtypes only, never values: that would cost a device sync).
"""

from __future__ import annotations

import math

import torch

from kiln.ops.attention.validate import host_checkable
from kiln.ops.checks import FLOAT_DTYPES, check_last_dim, check_same_dtype, check_tensor, device_of
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size, randint, randn

REDUCTIONS = ("mean", "sum")


def fused_linear_cross_entropy_reference(
    hidden,
    weight,
    labels,
    bias=None,
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    reduction="mean",
    compute_grads=True,
):
    """The plain definition: full logits, torch's cross_entropy, gradients by autograd."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (hidden, weight)]
        if bias is not None:
            leaves.append(bias.detach().requires_grad_())
        logits = leaves[0] @ leaves[1].T
        if bias is not None:
            logits = logits + leaves[2]
        labels = labels.long()
        loss = torch.nn.functional.cross_entropy(
            logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum"
        )
        valid = labels != ignore_index
        loss = loss + z_loss * logits.logsumexp(dim=-1)[valid].pow(2).sum()
        if reduction == "mean":
            loss = loss / valid.sum()
        if not compute_grads:
            empty = hidden.new_empty((0,))
            return loss.detach(), empty, weight.new_empty((0,)), empty
        grads = torch.autograd.grad(loss, leaves)
    grad_bias = grads[2] if bias is not None else hidden.new_empty((0,))
    return loss.detach(), grads[0], grads[1], grad_bias


def validate_fused_linear_cross_entropy(
    hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, reduction, compute_grads=True
) -> None:
    op = "fused_linear_cross_entropy"
    check_tensor(op, "hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,))
    device = device_of(hidden)
    check_tensor(op, "weight", weight, ndim=2, device=device)
    check_last_dim(op, "weight", weight, hidden.shape[-1], "hidden's size")
    check_same_dtype(op, hidden=hidden, weight=weight)
    check_tensor(op, "labels", labels, ndim=1, dtypes=(torch.int64, torch.int32), device=device)
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"{op}: labels has {labels.shape[0]} tokens, expected hidden's {hidden.shape[0]} (one per row)"
        )
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, device=device)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"{op}: bias has {bias.shape[0]} elements, expected the vocabulary {weight.shape[0]}"
            )
        check_same_dtype(op, hidden=hidden, bias=bias)
    if weight.shape[0] == 0:
        raise ValueError(f"{op}: weight has no rows; the vocabulary must be non-empty")
    if hidden.shape[0] == 0:  # a mean over no tokens is NaN: say so instead
        raise ValueError(f"{op}: hidden has no tokens (shape {tuple(hidden.shape)}); pass at least one row")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (z_loss >= 0.0 and math.isfinite(z_loss)):
        raise ValueError(f"{op}: z_loss must be a finite number >= 0, got {z_loss}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    # values: torch tensors where reading them is allowed, outside a compiled graph
    if not torch.compiler.is_compiling() and host_checkable(labels):
        vocab = weight.shape[0]
        bad = labels[((labels < 0) | (labels >= vocab)) & (labels != ignore_index)]
        if bad.numel():
            raise ValueError(
                f"{op}: labels has {int(bad[0])}, outside the vocabulary [0, {vocab}) and not "
                f"ignore_index ({ignore_index})"
            )


def fake_fused_linear_cross_entropy(
    hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, reduction, compute_grads=True
):
    loss_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    if not compute_grads:
        empty = hidden.new_empty((0,))
        return hidden.new_empty((), dtype=loss_dtype), empty, weight.new_empty((0,)), empty
    grad_bias = torch.empty_like(bias) if bias is not None else hidden.new_empty((0,))
    return (
        hidden.new_empty((), dtype=loss_dtype),
        torch.empty_like(hidden),
        torch.empty_like(weight),
        grad_bias,
    )


def _make_inputs(shape, dtype, device, generator):
    tokens, hidden_size, vocab = shape["tokens"], shape["hidden"], shape["vocab"]
    labels = randint((tokens,), 0, vocab, torch.int64, device, generator)
    if shape.get("ignored"):  # about a quarter of the tokens masked (padding, prompt tokens)
        drop = torch.rand((tokens,), generator=generator) < 0.25
        drop[0] = False  # at least one valid token: a mean over none is NaN by definition
        labels[drop.to(device)] = -100
    # Hidden states of norm ~1 per coordinate and a head of std 1/sqrt(H): logits of std ~1, as in
    # a trained LM head; scale 3 widens them to exercise exp() over a real range.
    return {
        "hidden": randn((tokens, hidden_size), dtype, device, generator, scale=3.0),
        "weight": randn((vocab, hidden_size), dtype, device, generator, scale=hidden_size**-0.5),
        "labels": labels,
        "bias": randn((vocab,), dtype, device, generator) if shape.get("bias") else None,
        "ignore_index": -100,
        "label_smoothing": shape.get("label_smoothing", 0.0),
        "z_loss": shape.get("z_loss", 0.0),
        "reduction": shape.get("reduction", "mean"),
    }


def _fuzz_shapes(rng):
    shapes = [
        {"tokens": 1, "hidden": 8, "vocab": 3},
        {"tokens": 37, "hidden": 24, "vocab": 301, "ignored": True},
        {"tokens": 19, "hidden": 16, "vocab": 517, "label_smoothing": 0.1, "bias": True},
        {"tokens": 23, "hidden": 32, "vocab": 129, "z_loss": 1e-4, "reduction": "sum", "ignored": True},
    ]
    shapes += [
        {
            "tokens": rng.randint(1, 64),
            "hidden": rng.randint(1, 64),
            "vocab": rng.randint(2, 2000),
            "ignored": rng.random() < 0.5,
            "label_smoothing": rng.choice([0.0, 0.0, 0.05]),
            "z_loss": rng.choice([0.0, 1e-3]),
            "reduction": rng.choice(REDUCTIONS),
        }
        for _ in range(3)
    ]
    return shapes


def _flops(shape, dtype):
    # logits, grad_hidden and grad_weight GEMMs; the softmax and its gradient are O(T V).
    return 6 * shape["tokens"] * shape["hidden"] * shape["vocab"] + 10 * shape["tokens"] * shape["vocab"]


def _bytes(shape, dtype):
    # hidden and weight read, both gradients written; the logits stay in a chunk (ideally in cache).
    t, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
    return 2 * (t * h + v * h) * element_size(dtype) + 8 * t


def _llm_shapes():
    return [
        {"tokens": tokens, "hidden": hidden, "vocab": vocab}
        for hidden, vocab in ((576, 49152), (4096, 128256))  # SmolLM2-135M, Llama-3-8B
        for tokens in (1024, 4096)
    ]


def _torch_eager(
    hidden, weight, labels, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean"
):
    """What training code does without fusion: full logits, then the loss and autograd."""
    return fused_linear_cross_entropy_reference(
        hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, reduction
    )


FUSED_LINEAR_CROSS_ENTROPY = OpSpec(
    name="fused_linear_cross_entropy",
    description="LM head + cross-entropy (ignore_index, label smoothing, z-loss) and its gradients, chunked",
    reference=fused_linear_cross_entropy_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # fp32: GEMM and summation order only. Halves: the logits are rounded once in the input dtype
    # (as every half-precision LM head does), which moves each probability by ~|z| * 2^-11 (fp16) /
    # 2^-8 (bf16) relatively, and the gradients are rounded once more on output: 3u (measured on the
    # CPU path: 0.7u in norm).
    tolerance={torch.float32: 2e-5, torch.float16: 1.5e-3, torch.bfloat16: 1.2e-2},
    flops=_flops,
    bytes=_bytes,
    bench_shapes={"llm": _llm_shapes()},
    baselines={"torch_eager": _torch_eager},
    schema=(
        "(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias=None, int ignore_index=-100, "
        "float label_smoothing=0.0, float z_loss=0.0, str reduction='mean', bool compute_grads=True) "
        "-> (Tensor, Tensor, Tensor, Tensor)"
    ),
    validate=validate_fused_linear_cross_entropy,
    fake=fake_fused_linear_cross_entropy,
    call_case=lambda hidden, weight, labels, *rest: (
        ({"tokens": hidden.shape[0], "hidden": hidden.shape[1], "vocab": weight.shape[0]}, hidden.dtype)
        if rest[-1]  # compute_grads: the FLOP and byte model counts the gradients
        else None
    ),
    doc=__doc__,
)

fused_linear_cross_entropy = define_op(FUSED_LINEAR_CROSS_ENTROPY, "kiln.ops")
