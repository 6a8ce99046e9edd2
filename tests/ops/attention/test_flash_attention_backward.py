"""FlashAttention backward (kiln.ops.flash_attention_backward and autograd through
kiln.ops.autograd.flash_attention): dq, dk, dv against autograd through the float64 forward reference,
on the Triton kernels (interpreted on a CPU) and the CPU path; gradcheck; torch.compile; sm_90 AOT."""

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

import kiln.ops
from kiln.ops import autograd as ka
from kiln.ops.attention.flash_attention.spec import flash_attention_with_lse_reference
from kiln.ops.attention.flash_attention_backward import FLASH_ATTENTION_BACKWARD
from kiln.verify import run_case
from tests.ops.autograd_checks import grad_errors

CASES = {
    # single tokens, an empty sequence (its keys get zero gradients), causal, no GQA
    "tiny-empty-seq": {"seqlens_q": [1, 0, 7], "seqlens_k": [1, 4, 7], "num_heads": 2, "num_kv_heads": 2,
                       "head_dim": 64},
    # GQA 3:1, k_len > q_len (bottom-right causal), a gradient for the LSE too
    "gqa3-varlen-grad-lse": {"seqlens_q": [33, 5, 1], "seqlens_k": [33, 21, 19], "num_heads": 3,
                             "num_kv_heads": 1, "head_dim": 64, "grad_lse": True},
    # head_dim 80 (padded to 128 in the kernel), causal sliding window, soft-capping
    "window-softcap-d80": {"seqlens_q": [29], "seqlens_k": [45], "num_heads": 3, "num_kv_heads": 1,
                           "head_dim": 80, "sliding_window": 7, "softcap": 5.0},
    # not causal, with a window (keys after a query stay visible)
    "noncausal-window-d96": {"seqlens_q": [18, 33], "seqlens_k": [40, 33], "num_heads": 2,
                             "num_kv_heads": 2, "head_dim": 96, "causal": False, "sliding_window": 9},
    # more queries than keys: the first 13 queries see no key (lse -inf, zero gradients)
    "queries-without-keys": {"seqlens_q": [20, 5], "seqlens_k": [7, 5], "num_heads": 3, "num_kv_heads": 1,
                             "head_dim": 64},
}  # fmt: skip


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_flash_attention_backward_matches_float64_autograd(case, dtype, backend, device):
    # run_case: fresh inputs, poisoned outputs, the relative error of each of dq, dk, dv (NaN fails).
    result = run_case(FLASH_ATTENTION_BACKWARD, backend, CASES[case], dtype, device, random.randrange(2**31))
    assert result.passed, result


@pytest.mark.parametrize("case", list(CASES))
def test_flash_attention_backward_cpu_path_in_bfloat16(case):
    """bf16 on the CPU path (float32 math); the Triton kernels' bf16 dots are checked on a GPU only."""
    result = run_case(
        FLASH_ATTENTION_BACKWARD,
        "cpu",
        CASES[case],
        torch.bfloat16,
        torch.device("cpu"),
        random.randrange(2**31),
    )
    assert result.passed, result


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_flash_attention_backward_large_head_dims(head_dim, backend, device):
    shape = {"seqlens_q": [19], "seqlens_k": [23], "num_heads": 2, "num_kv_heads": 1, "head_dim": head_dim}
    result = run_case(
        FLASH_ATTENTION_BACKWARD, backend, shape, torch.float16, device, random.randrange(2**31)
    )
    assert result.passed, result


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_flash_attention_backward_bfloat16_on_gpu(case):
    result = run_case(
        FLASH_ATTENTION_BACKWARD,
        "triton",
        CASES[case],
        torch.bfloat16,
        torch.device("cuda"),
        random.randrange(2**31),
    )
    assert result.passed, result


@pytest.mark.gpu
def test_flash_attention_backward_is_deterministic_on_gpu():
    """No atomics: two runs of a long GQA causal backward give bit-identical gradients."""
    shape = {
        "batch": 2,
        "seqlen_q": 1500,
        "seqlen_k": 1500,
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 128,
    }
    inputs = FLASH_ATTENTION_BACKWARD.make_inputs(
        shape, torch.bfloat16, torch.device("cuda"), torch.Generator().manual_seed(0)
    )
    first = kiln.ops.flash_attention_backward(**inputs)
    second = kiln.ops.flash_attention_backward(**inputs)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def _varlen(device, dtype, lens_q, lens_k, heads, kv_heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), heads, head_dim, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(sum(lens_k), kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(sum(lens_k), kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)

    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_autograd_through_flash_attention_matches_float64_autograd(backend, device, monkeypatch):
    """loss = sum(out * u) + sum(lse * w): both outputs' gradients reach q, k and v."""
    monkeypatch.setenv("KILN_BACKEND", backend)
    lens_q, lens_k = [9, 4], [9, 11]
    q, k, v, cu_q, cu_k = _varlen(device, torch.float32, lens_q, lens_k, 3, 1, 64, random.randrange(2**31))
    options = dict(causal=True, sliding_window=6)

    def kiln_fn(q, k, v):
        return ka.flash_attention(q, k, v, cu_q, cu_k, 9, 11, return_lse=True, **options)

    def reference_fn(q, k, v):
        return flash_attention_with_lse_reference(q, k, v, cu_q, cu_k, 9, 11, **options)

    errors = grad_errors(kiln_fn, reference_fn, [q, k, v])
    assert max(errors) <= FLASH_ATTENTION_BACKWARD.tolerance[torch.float32], errors


def test_flash_attention_gradcheck_float64(monkeypatch):
    """Finite differences of the forward against the backward (CPU path, float64 throughout)."""
    monkeypatch.delenv("KILN_BACKEND", raising=False)
    q, k, v, cu_q, cu_k = _varlen("cpu", torch.float64, [3, 5], [4, 5], 3, 1, 64, 0)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    # fast_mode: the Jacobian against random directions (seconds instead of one probe per element).
    assert torch.autograd.gradcheck(
        lambda q, k, v: ka.flash_attention(q, k, v, cu_q, cu_k, 5, 5, sliding_window=3, softcap=2.0),
        leaves,
        fast_mode=True,
    )


def test_torch_compile_fullgraph_backpropagates_through_flash_attention(monkeypatch):
    monkeypatch.delenv("KILN_BACKEND", raising=False)
    torch._dynamo.reset()

    def loss_fn(q, k, v, cu_q, cu_k):
        out = ka.flash_attention(q, k, v, cu_q, cu_k, 7, 7, causal=True)
        return (out * out).sum()

    inputs = _varlen("cpu", torch.float32, [7, 2], [7, 5], 4, 2, 64, 1)
    eager_leaves = [t.clone().requires_grad_() for t in inputs[:3]]
    compiled_leaves = [t.clone().requires_grad_() for t in inputs[:3]]
    loss_fn(*eager_leaves, *inputs[3:]).backward()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    compiled(*compiled_leaves, *inputs[3:]).backward()
    for got, want in zip(compiled_leaves, eager_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_opcheck_flash_attention_backward():
    inputs = FLASH_ATTENTION_BACKWARD.make_inputs(
        CASES["gqa3-varlen-grad-lse"], torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0)
    )
    args = FLASH_ATTENTION_BACKWARD.bind((), inputs)
    torch.library.opcheck(torch.ops.kiln.flash_attention_backward.default, args)


def test_opcheck_flash_attention_with_lse_autograd_registration():
    """With inputs that require grad: the registered backward, under fake tensors and AOT dispatch."""
    q, k, v, cu_q, cu_k = _varlen("cpu", torch.float32, [3, 5], [3, 5], 4, 2, 64, 2)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(
        torch.ops.kiln.flash_attention_with_lse.default, (*leaves, cu_q, cu_k, 5, 5, True, None, 3, 20.0)
    )


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("dout", lambda i: i["dout"][:-1], "dout has shape"),
        ("out", lambda i: i["out"].half(), "out"),
        ("lse", lambda i: i["lse"].t().contiguous(), r"lse has shape .* expected \[num_heads, total_q\]"),
        ("grad_lse", lambda i: i["lse"].double(), "grad_lse is float64, expected lse's float32"),
        ("q", lambda i: i["q"][..., :48].contiguous(), "head_dim 48"),
    ],
)
def test_flash_attention_backward_rejects_bad_input(name, value, message):
    inputs = FLASH_ATTENTION_BACKWARD.make_inputs(
        CASES["tiny-empty-seq"], torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0)
    )
    inputs[name] = value(inputs)
    with pytest.raises(ValueError, match=message):
        kiln.ops.flash_attention_backward(**inputs)


# Both kernels, with every optional branch, compiled for sm_90 in a fresh process
# without TRITON_INTERPRET (the interpreter accepts things the compiler rejects).
_AOT_SCRIPT = textwrap.dedent(
    """
    import importlib
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    module = importlib.import_module("kiln.ops.attention.flash_attention_backward.triton")

    def build(kernel, signature, constexprs, **options):
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        source = ASTSource(fn=getattr(module, kernel), signature=signature, constexprs=constexprs)
        compile(source, target=GPUTarget("cuda", 90, 32), options=options)

    ints = {n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_lse_h",
                               "num_queries_per_kv")}
    floats = {"sm_scale": "fp32", "softcap": "fp32", "window": "i32"}
    # bf16 (the training dtype) with every optional branch on; head_dim 80 exercises the padded BLOCK_D.
    for dtype, head_dim, flags in (("*bf16", 80, (True, True, True)),):
        causal, window, softcap = flags
        common = {"HEAD_DIM": head_dim, "CAUSAL": causal, "HAS_WINDOW": window, "HAS_SOFTCAP": softcap,
                  "IEEE": dtype == "*fp32", "BLOCK_D": 128}
        build("_backward_dq_kernel",
              {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "out_ptr": dtype, "dout_ptr": dtype,
               "lse_ptr": "*fp32", "grad_lse_ptr": "*fp32", "delta_ptr": "*fp32", "dq_ptr": dtype,
               "cu_seqlens_q_ptr": "*i32", "cu_seqlens_k_ptr": "*i32", **ints, **floats},
              {**common, "HAS_GRAD_LSE": softcap, "BLOCK_Q": 64, "BLOCK_K": 32}, num_warps=8, num_stages=2)
        build("_backward_dkdv_kernel",
              {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "dout_ptr": dtype, "lse_ptr": "*fp32",
               "delta_ptr": "*fp32", "dk_ptr": dtype, "dv_ptr": dtype, "cu_seqlens_q_ptr": "*i32",
               "cu_seqlens_k_ptr": "*i32", **ints, **floats},
              {**common, "BLOCK_Q": 32, "BLOCK_K": 64}, num_warps=8, num_stages=2)
    print("compiled")
    """
)


def test_flash_attention_backward_kernels_compile_for_sm90_without_a_gpu():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
