"""Fused mixture-of-experts MLP (SwiGLU experts), given the routing.

fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None)
    x:            [num_tokens, hidden]                    float32 / float16 / bfloat16
    w_gate_up:    [num_experts, 2 * intermediate, hidden] x's dtype, or float8_e4m3fn; rows
                  0..intermediate-1 are the gate projection, the rest the up projection
    w_down:       [num_experts, hidden, intermediate]     x's dtype, or float8_e4m3fn
    topk_weights: [num_tokens, top_k] float32 (any float dtype accepted)
    topk_ids:     [num_tokens, top_k] int32 / int64, values in [0, num_experts)
    w_*_scale:    float32 [num_experts], required with (and only with) float8 weights:
                  the expert's real weight is w.float() * scale[e]
    out[t] = sum_j topk_weights[t, j] * E_{topk_ids[t, j]}(x[t]),
    E_e(v) = W_down[e] @ (silu(W_gate[e] @ v) * (W_up[e] @ v)); returns [num_tokens, hidden] in x's dtype.
    The hidden activation silu(..) * (..) is rounded to x's dtype (as a model would hold it); every
    GEMM accumulates in float32.
Expert ids are range-checked (one fused min/max, read back once: a device sync on a GPU) unless
inside `kiln.ops.trusted_inputs()`; unchecked, a pair whose id is out of range adds nothing to its
token's output and no kernel reads past the expert weights.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from kiln.ops.checks import FLOAT_DTYPES, check_tensor, device_of, dtype_name
from kiln.ops.moe.moe_route.spec import distinct_logits, moe_route_reference
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import compute_dtype, element_size, randn

OP = "fused_moe"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _expert_weights(w, scale, dtype):
    w = w.to(dtype)
    return w if scale is None else w * scale.to(dtype)[:, None, None]


def fused_moe_reference(
    x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None
):
    """The plain per-expert loop: gather the expert's tokens, run its MLP, scatter-add back."""
    ct = compute_dtype(x.dtype)
    xf = x.to(ct)
    w_gu = _expert_weights(w_gate_up, w_gate_up_scale, ct)
    w_d = _expert_weights(w_down, w_down_scale, ct)
    intermediate = w_d.shape[2]
    out = torch.zeros((x.shape[0], w_d.shape[1]), dtype=ct, device=x.device)
    for expert in range(w_gu.shape[0]):
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = xf[token] @ w_gu[expert].T
        hidden = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        hidden = hidden.to(x.dtype).to(ct)
        out.index_add_(0, token, (hidden @ w_d[expert].T) * topk_weights[token, slot, None].to(ct))
    return out.to(x.dtype)


def _check_weight(name, w, x, scale, scale_name):
    check_tensor(OP, name, w, ndim=3, dtypes=(x.dtype, FP8), device=device_of(x))
    if dtype_name(w.dtype) == dtype_name(FP8):
        if scale is None:
            raise ValueError(f"{OP}: {name} is float8_e4m3fn, pass {scale_name} (float32 [num_experts])")
        check_tensor(
            OP, scale_name, scale, ndim=1, dtypes=(torch.float32, torch.float64), device=device_of(x)
        )
        if scale.shape[0] != w.shape[0]:
            raise ValueError(
                f"{OP}: {scale_name} has {scale.shape[0]} entries, expected num_experts {w.shape[0]}"
            )
    elif scale is not None:
        raise ValueError(
            f"{OP}: {scale_name} is only for float8_e4m3fn weights; {name} is {dtype_name(w.dtype)}"
        )


def values_readable(tensor) -> bool:
    """Whether a check may read `tensor`'s values on the host: not for fake or meta tensors (a
    compiler propagating shapes through the fake), not while torch.compile traces, not during
    CUDA-graph capture (a device-to-host copy is illegal there)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or is_fake(tensor):
        return False
    if torch.compiler.is_compiling():
        return False
    return tensor.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def check_expert_ids(topk_ids, num_experts: int) -> None:
    """Every id in [0, num_experts): one fused min/max over the ids, read back once."""
    if values_readable(topk_ids) and topk_ids.numel():  # a JAX array has no numel: not readable
        low, high = torch.stack(torch.aminmax(topk_ids)).tolist()
        if low < 0 or high >= num_experts:
            raise ValueError(f"{OP}: topk_ids has values in [{low}, {high}], expected [0, {num_experts})")


def validate_fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale) -> None:
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,))
    _check_weight("w_gate_up", w_gate_up, x, w_gate_up_scale, "w_gate_up_scale")
    _check_weight("w_down", w_down, x, w_down_scale, "w_down_scale")
    num_experts, two_n, hidden = w_gate_up.shape
    if hidden != x.shape[1]:
        raise ValueError(f"{OP}: w_gate_up has in-features {hidden}, expected x's hidden size {x.shape[1]}")
    if two_n % 2:
        raise ValueError(f"{OP}: w_gate_up has {two_n} rows per expert, expected 2 * intermediate (even)")
    expected = (num_experts, hidden, two_n // 2)
    if tuple(w_down.shape) != expected:
        raise ValueError(
            f"{OP}: w_down has shape {tuple(w_down.shape)}, expected [num_experts, hidden, "
            f"intermediate] = {list(expected)}"
        )
    check_tensor(OP, "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), device=device_of(x))
    check_tensor(
        OP, "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,), device=device_of(x)
    )
    if topk_ids.shape[0] != x.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"{OP}: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [num_tokens={x.shape[0]}, top_k]"
        )
    if topk_ids.shape[1] == 0:
        raise ValueError(f"{OP}: topk_ids has shape {tuple(topk_ids.shape)}; top_k must be >= 1")
    check_expert_ids(topk_ids, num_experts)


def quantize_experts_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert symmetric e4m3 quantization of `[E, out, in]` weights -> (w_fp8, scale float32 [E])."""
    amax = w.abs().amax(dim=(1, 2)).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (w.float() / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _make_inputs(shape, dtype, device, generator):
    tokens, hidden, inter = shape["tokens"], shape["hidden"], shape["intermediate"]
    experts, top_k = shape["experts"], shape["top_k"]
    # Weights scaled by 1/sqrt(fan-in) so every stage stays O(1) in any dtype.
    w_gate_up = randn((experts, 2 * inter, hidden), torch.float32, "cpu", generator, scale=hidden**-0.5)
    w_down = randn((experts, hidden, inter), torch.float32, "cpu", generator, scale=inter**-0.5)
    logits = distinct_logits(tokens, experts, torch.float32, "cpu", generator)
    if shape.get("skew"):  # uneven routing: low-numbered experts win far more often, some get none
        logits = logits + torch.arange(experts, 0, -1, dtype=torch.float32) * shape["skew"]
    topk_weights, topk_ids = moe_route_reference(logits, top_k, renormalize=True)
    inputs = {
        "x": randn((tokens, hidden), dtype, device, generator),
        "w_gate_up": w_gate_up.to(dtype=dtype, device=device),
        "w_down": w_down.to(dtype=dtype, device=device),
        "topk_weights": topk_weights.to(device),
        "topk_ids": topk_ids.to(device),
        "w_gate_up_scale": None,
        "w_down_scale": None,
    }
    if shape.get("fp8"):
        for name in ("w_gate_up", "w_down"):
            w8, scale = quantize_experts_fp8(inputs[name].float())
            inputs[name], inputs[name + "_scale"] = w8.to(device), scale.to(device)
    return inputs


def _fuzz_shapes(rng):
    shapes = [
        {"tokens": 1, "hidden": 64, "intermediate": 48, "experts": 8, "top_k": 2},
        {"tokens": 11, "hidden": 40, "intermediate": 24, "experts": 4, "top_k": 2, "skew": 1.0},
        {"tokens": 7, "hidden": 33, "intermediate": 19, "experts": 6, "top_k": 1, "fp8": True},
        {"tokens": 3, "hidden": 72, "intermediate": 40, "experts": 8, "top_k": 8},
        {"tokens": 21, "hidden": 48, "intermediate": 56, "experts": 5, "top_k": 2, "fp8": True, "skew": 0.7},
    ]
    experts = rng.randint(2, 10)
    shapes.append(
        {
            "tokens": rng.randint(1, 40),
            "hidden": rng.randint(16, 90),
            "intermediate": rng.randint(16, 70),
            "experts": experts,
            "top_k": rng.randint(1, min(experts, 4)),
            "fp8": rng.random() < 0.4,
            "skew": rng.choice([0.0, 0.5]),
        }
    )
    return shapes


def experts_hit(shape) -> float:
    """Expected number of distinct experts a batch touches under uniform routing: only those
    experts' weights are read."""
    experts, top_k, tokens = shape["experts"], shape["top_k"], shape["tokens"]
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _flops(shape, dtype):
    pairs = shape["tokens"] * shape["top_k"]
    return 6 * pairs * shape["hidden"] * shape["intermediate"]


def _bytes(shape, dtype):
    tokens, hidden, inter, top_k = shape["tokens"], shape["hidden"], shape["intermediate"], shape["top_k"]
    w_size = 1 if shape.get("fp8") else element_size(dtype)
    weights = experts_hit(shape) * 3 * inter * hidden * w_size
    activations = 2 * tokens * hidden * element_size(dtype)  # x in, out
    scratch = tokens * top_k * (2 * inter * element_size(dtype) + 2 * hidden * 4)  # hidden act, fp32 partials
    return weights + activations + scratch


_LOOP_FP8_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def per_expert_loop(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None):
    """Baseline: the Hugging Face style loop over experts in x's dtype (one mask + gather per expert).
    FP8 experts are dequantized once per weight tensor (cached, as an fp8 checkpoint served by such a
    loop would be): dequantizing every expert in each timed call made 142x of its CPU time conversion."""
    if w_gate_up.dtype == FP8:
        scales = tuple(None if t is None else t.data_ptr() for t in (w_gate_up_scale, w_down_scale))
        key = (w_gate_up.data_ptr(), w_down.data_ptr(), *scales, tuple(w_gate_up.shape), x.dtype)
        if key not in _LOOP_FP8_CACHE:
            if len(_LOOP_FP8_CACHE) >= 8:
                _LOOP_FP8_CACHE.clear()
            _LOOP_FP8_CACHE[key] = (
                _expert_weights(w_gate_up, w_gate_up_scale, x.dtype),
                _expert_weights(w_down, w_down_scale, x.dtype),
            )
        w_gu, w_d = _LOOP_FP8_CACHE[key]
    else:
        w_gu = _expert_weights(w_gate_up, w_gate_up_scale, x.dtype)
        w_d = _expert_weights(w_down, w_down_scale, x.dtype)
    inter = w_d.shape[2]
    out = torch.zeros_like(x)
    for expert in range(w_gu.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        gate_up = x[token] @ w_gu[expert].T
        hidden = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, (hidden @ w_d[expert].T) * topk_weights[token, slot, None].to(x.dtype))
    return out


_DENSE_FP8_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def dense_equivalent(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None):
    """Baseline: one dense SwiGLU MLP (expert 0's weights) over all num_tokens * top_k token-expert
    pairs: the MoE layer's FLOPs as plain cuBLAS GEMMs, what the grouped GEMM should approach when
    every expert gets many tokens. FP8 experts are converted once per weight tensor (cached), so
    the timing is of the GEMMs alone."""
    top_k = topk_ids.shape[1]
    w_gu, w_d = w_gate_up[0], w_down[0]
    if w_gu.dtype == FP8:
        key = (w_gate_up.data_ptr(), w_down.data_ptr(), x.dtype)
        if key not in _DENSE_FP8_CACHE:
            if len(_DENSE_FP8_CACHE) >= 8:
                _DENSE_FP8_CACHE.clear()
            _DENSE_FP8_CACHE[key] = (w_gu.to(x.dtype), w_d.to(x.dtype))
        w_gu, w_d = _DENSE_FP8_CACHE[key]
    inter = w_d.shape[1]
    gate_up = x.repeat_interleave(top_k, dim=0) @ w_gu.T
    return (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w_d.T


def _llm_shapes():
    mixtral = {"hidden": 4096, "intermediate": 14336, "experts": 8, "top_k": 2}  # Mixtral-8x7B
    return [{"tokens": t, **mixtral, **extra} for extra in ({}, {"fp8": True}) for t in (1, 16, 64, 4096)]


FUSED_MOE = OpSpec(
    name=OP,
    description="Fused MoE SwiGLU MLP: grouped gate/up GEMM + SiLU-mul, grouped down GEMM, top-k sum",
    reference=fused_moe_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # fp32: float32 accumulation only (~1e-6 relative over these K). Halves: the hidden
    # activation and the output are each rounded once to the dtype (unit roundoff 2^-11 / 2^-8,
    # about half that as an rms relative error each), the fp32 top-k partials add nothing: 3u
    # (measured on the CPU path: 1.1u in norm). FP8 weights are compared against their exact
    # dequantized values, so no extra error.
    tolerance={torch.float32: 2e-5, torch.float16: 1.5e-3, torch.bfloat16: 1.2e-2},
    flops=_flops,
    bytes=_bytes,
    bench_shapes={"llm": _llm_shapes()},
    baselines={"per_expert_loop": per_expert_loop, "dense_equivalent": dense_equivalent},
    gpu_only_dtypes={"triton": (torch.bfloat16,)},
    schema=(
        "(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor topk_weights, Tensor topk_ids, "
        "Tensor? w_gate_up_scale=None, Tensor? w_down_scale=None) -> Tensor"
    ),
    validate=validate_fused_moe,
    fake=lambda x, *args: torch.empty_like(x),
    call_case=lambda x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale: (
        {"tokens": x.shape[0], "hidden": x.shape[1], "intermediate": w_down.shape[2],
         "experts": w_gate_up.shape[0], "top_k": topk_ids.shape[1], "fp8": w_gate_up_scale is not None},
        x.dtype,
    ),  # fmt: skip
    doc=__doc__,
)

fused_moe = define_op(FUSED_MOE, "kiln.ops")
