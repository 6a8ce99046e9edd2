import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

import kiln.ops
import kiln.tune.cache
from kiln.ops.gemm.dense_spec import LINEAR, LINEAR_SILU_MUL
from kiln.ops.gemm.dense_triton import linear_silu_mul_triton, linear_triton
from kiln.verify import assert_close, run_case

SHAPES = [
    {"M": 1, "N": 37, "K": 200, "bias": True},  # decode: split-K path
    {"M": 17, "N": 33, "K": 77},  # every dim odd: all masks
    {"M": 70, "N": 45, "K": 40, "bias": True},  # several M tiles: grouped order
]


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(LINEAR, backend, shape, dtype, device, seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [{"M": 1, "N": 37, "K": 200}, {"M": 19, "N": 21, "K": 65}])
def test_linear_silu_mul_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(LINEAR_SILU_MUL, backend, shape, dtype, device, seed())
    assert case.passed, case


def _config(block_m, block_n, block_k, split_k, group_m=2):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m,
            "SPLIT_K": split_k, "num_warps": 4, "num_stages": 2}  # fmt: skip


@pytest.mark.parametrize("split_k", [1, 3])
def test_linear_explicit_configs_grouped_tiles_and_uneven_split_k(split_k, device):
    # 3 x 4 output tiles walked in groups of 2 rows; K = 100 over 3 splits of 2 x 16 (the last is short).
    x = torch.randn(40, 100, device=device)
    w = torch.randn(50, 100, device=device) / 10
    bias = torch.randn(50, device=device)
    out = linear_triton(x, w, bias, config=_config(16, 16, 16, split_k))
    assert_close(out, x.double() @ w.double().T + bias.double(), 1e-5)


def test_linear_silu_mul_split_k_keeps_gate_and_up_apart(device):
    x = torch.randn(5, 90, device=device)
    w = torch.randn(2 * 24, 90, device=device) / 10
    out = linear_silu_mul_triton(x, w, config=_config(16, 16, 16, 4))
    gate, up = x.double() @ w[:24].double().T, x.double() @ w[24:].double().T
    assert_close(out, torch.nn.functional.silu(gate) * up, 1e-5)


def test_linear_takes_3d_input_and_transposed_weight(device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "triton")
    x = torch.randn(2, 3, 48, device=device)
    w = torch.randn(48, 29, device=device).T  # [29, 48] view with unit stride along N, not K
    out = kiln.ops.linear(x, w)
    assert out.shape == (2, 3, 29)
    assert_close(out, x.double() @ w.double().T, 1e-5)


def test_linear_reads_the_tuning_cache(tmp_path, monkeypatch):
    # A tuned entry for this op/shape bucket must be used: an incomplete one is reported, not ignored.
    monkeypatch.setenv("KILN_TUNE_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setattr(kiln.tune.cache, "_user_entries", None)
    shape = {"M": 4, "N": 8, "K": 16, "bias": False}
    kiln.tune.store("linear", torch.float32, shape, {"BLOCK_M": 16})
    with pytest.raises(ValueError, match="missing BLOCK_N"):
        linear_triton(torch.randn(4, 16), torch.randn(8, 16))
    kiln.tune.store("linear", torch.float32, shape, _config(16, 16, 16, 2))
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    assert_close(linear_triton(x, w), x.double() @ w.double().T, 1e-5)
    monkeypatch.setattr(kiln.tune.cache, "_user_entries", None)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: (torch.randn(2, 8), torch.randn(4, 7), None),
            "weight has last dim 7, expected x's in-features 8",
        ),
        (lambda: (torch.randn(2, 8), torch.randn(4, 8).half(), None), "must share one dtype"),
        (lambda: (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5)), "bias has last dim 5"),
        (lambda: (torch.randint(0, 3, (2, 8)), torch.randn(4, 8), None), "x has dtype int64"),
        (lambda: (torch.randn(2, 8), torch.randn(8), None), "weight must have 2 dims"),
    ],
)
def test_linear_rejects_bad_input(make, message):
    x, w, bias = make()
    with pytest.raises(ValueError, match=message):
        kiln.ops.linear(x, w, bias)


def test_linear_silu_mul_rejects_odd_gate_up_rows():
    with pytest.raises(ValueError, match="expected an even 2N"):
        kiln.ops.linear_silu_mul(torch.randn(2, 8), torch.randn(7, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [LINEAR, LINEAR_SILU_MUL])
@pytest.mark.parametrize(
    "shape", [{"M": 1, "N": 4096, "K": 4096}, {"M": 300, "N": 577, "K": 1000, "bias": True}]
)
def test_linear_bfloat16_on_gpu(spec, shape):
    case = run_case(spec, "triton", shape, torch.bfloat16, torch.device("cuda"), seed())
    assert case.passed, case


def _custom_op_args():
    """Small CPU arguments for every torch.ops.kiln GEMM op."""
    from kiln.quant import quantize_blocks, quantize_int4

    g = torch.Generator().manual_seed(0)
    x, w, bias = (
        torch.randn(3, 64, generator=g),
        torch.randn(24, 64, generator=g) / 8,
        torch.randn(24, generator=g),
    )
    x8, xs8 = kiln.ops.quantize_int8(x)
    w8, ws8 = kiln.ops.quantize_int8(w)
    xf, xsf = kiln.ops.quantize_fp8(x)
    wf, wsf = kiln.ops.quantize_fp8(w)
    return {
        "linear": (x, w, bias),
        "linear_silu_mul": (x, w),
        "quantize_fp8": (x, False),
        "quantize_int8": (x,),
        "fp8_linear": (xf, xsf, wf, wsf, None, torch.float32),
        "int8_linear": (x8, xs8, w8, ws8, bias, torch.float16),
        "int4_linear": (x, *quantize_int4(w, 32), 32),
        "gguf_dequantize": (quantize_blocks(w, "Q4_1"), "Q4_1", torch.float16),
        "gguf_linear": (x, quantize_blocks(w, "Q8_0"), "Q8_0", bias),
    }


@pytest.mark.parametrize("name", sorted(_custom_op_args()))
def test_gemm_custom_op_schema_fake_and_dispatch_registrations(name):
    from kiln.ops.gemm.library import REGISTERED

    assert name in REGISTERED
    # opcheck's schema test compares inputs with arithmetic that CPU float8 tensors lack: skip it there.
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    kwargs = {"test_utils": utils} if name == "fp8_linear" else {}
    torch.library.opcheck(getattr(torch.ops.kiln, name).default, _custom_op_args()[name], **kwargs)


def test_torch_compile_fullgraph_traces_a_quantized_mlp_through_gemm_custom_ops():
    from kiln.quant import quantize_blocks, quantize_int4

    w_gate_up, w_down = torch.randn(2 * 40, 64) / 8, torch.randn(64, 40) / 8
    q_gate_up = quantize_blocks(w_gate_up, "Q4_1")
    q_down = quantize_int4(w_down, 32)

    def mlp(x):
        h = torch.ops.kiln.linear_silu_mul(
            x, torch.ops.kiln.gguf_dequantize(q_gate_up, "Q4_1", torch.float32)
        )
        h8, scale = torch.ops.kiln.quantize_int8(h)
        h = torch.ops.kiln.int8_linear(h8, scale, *kiln.ops.quantize_int8(torch.eye(40)), None, torch.float32)
        return (
            torch.ops.kiln.int4_linear(h, *q_down, 32)
            + torch.ops.kiln.gguf_linear(x, q_gate_up, "Q4_1", None)[:, :64]
        )

    torch._dynamo.reset()
    x = torch.randn(5, 64)
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    assert_close(compiled(x), mlp(x), 1e-6)


_AOT_SCRIPT = textwrap.dedent(
    """
    import importlib
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    def build(module, kernel, signature, constexprs, aligned=()):
        fn = getattr(importlib.import_module(f"kiln.ops.gemm.{module}"), kernel)
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        # What a real launch infers for 16-divisible pointers and sizes (enables vector loads, cp.async).
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        return compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})

    i32 = "i32"
    tiles = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}
    gemm = {"M": i32, "N": i32, "K": i32, "stride_xm": i32, "stride_om": i32, "stride_on": i32}
    gemm["partial_ptr"] = "*fp32"
    aligned = ("x_ptr", "out_ptr", "stride_xm", "stride_om", "K", "N")
    dense = build("dense_triton", "_linear_kernel",
                  {**gemm, "x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
                   "stride_xk": i32, "stride_wn": i32, "stride_wk": i32},
                  {"HAS_BIAS": False, "SILU_MUL": True, "DOT_PRECISION": "tf32", **tiles, "SPLIT_K": 2},
                  aligned + ("w_ptr", "stride_wn"))
    assert "wgmma" in dense.asm["ptx"], "dense bf16 GEMM does not use Hopper tensor cores"
    for q, acc, zero in (("*fp8e4nv", tl.float32, 0.0), ("*i8", tl.int32, 0)):
        build("scaled_triton", "_scaled_linear_kernel",
              {**gemm, "x_ptr": q, "w_ptr": q, "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32",
               "bias_ptr": "*bf16", "out_ptr": "*bf16", "stride_xk": i32, "stride_wn": i32, "stride_wk": i32},
              {"X_PER_TOKEN": True, "W_PER_CHANNEL": True, "HAS_BIAS": True, "ACC_DTYPE": acc, "ZERO": zero,
               **tiles, "SPLIT_K": 1}, aligned)
        build("scaled_triton", "_quantize_rows_kernel",
              {"x_ptr": "*bf16", "q_ptr": q, "scale_ptr": "*fp32", "amax_ptr": "*fp32", "K": i32,
               "stride_xm": i32, "stride_qm": i32, "qmax": "fp32", "amax_floor": "fp32"},
              {"PER_TOKEN": acc == tl.float32, "IS_INT8": acc == tl.int32, "BLOCK": 1024})
    for group_size in (128, 32):  # K tile inside one group / spanning two
        build("int4_triton", "_int4_linear_kernel",
              {**gemm, "x_ptr": "*bf16", "qweight_ptr": "*i32", "scales_ptr": "*bf16", "zeros_ptr": "*u8",
               "out_ptr": "*bf16", "stride_xk": i32, "stride_qn": i32, "stride_sn": i32, "stride_zn": i32},
              {"GROUP_SIZE": group_size, "DOT_PRECISION": "tf32", **tiles, "SPLIT_K": 1}, aligned)
    gguf = {**gemm, "x_ptr": "*bf16", "qweight_ptr": "*u8", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    gguf["stride_qn"] = i32
    build("gguf_triton", "_gguf_gemv_kernel", gguf,
          {"QTYPE": "Q4_1", "BLOCK_BYTES": 20, "HAS_BIAS": True, "BLOCK_N": 64, "BLOCK_K": 128,
           "SPLIT_K": 4})
    build("gguf_triton", "_gguf_gemm_kernel", gguf,
          {"QTYPE": "Q4_0", "BLOCK_BYTES": 18, "HAS_BIAS": False, "DOT_PRECISION": "tf32", **tiles,
           "SPLIT_K": 1})
    build("gguf_triton", "_dequantize_kernel",
          {"qweight_ptr": "*u8", "out_ptr": "*fp32", "N": i32, "K": i32, "stride_qn": i32, "stride_on": i32},
          {"QTYPE": "Q8_0", "BLOCK_BYTES": 34, "BLOCK_N": 32, "BLOCK_K": 128})
    build("tiling", "split_k_reduce_kernel",
          {"partial_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "M": i32, "N": i32,
           "stride_om": i32, "stride_on": i32},
          {"SPLIT_K": 4, "HAS_BIAS": False, "SILU_MUL": True, "BLOCK_M": 32, "BLOCK_N": 64})
    print("compiled")
    """
)  # fmt: skip


def test_gemm_kernels_compile_for_sm90_without_a_gpu():
    # The interpreter never compiles: this catches what only the real compiler rejects (layouts, fp8
    # and int8 dots, bitcasts) and checks the dense GEMM lowers to wgmma on Hopper.
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
