"""How the foundation ops meet compilers. torch.ops.kiln.*: the registered custom ops agree with
the plain functions, trace through torch.compile(fullgraph=True) without graph breaks, and give the
right shapes on fake tensors. And the Triton kernels behind them compile for a real GPU (sm_90),
which the interpreter used by every other CPU test never checks."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.ops
from kiln.verify import assert_close

# The foundation ops this file builds inputs for (other families test their custom ops beside them).
REGISTERED = ("rms_norm", "layer_norm", "softmax", "silu_and_mul", "gelu_tanh_and_mul", "rotary_embedding")

def _inputs(device, dtype=torch.float32, tokens=5, hidden=96):
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return {
        "x": randn(tokens, hidden),
        "residual": randn(tokens, hidden),
        "weight": randn(hidden) + 1.0,
        "bias": randn(hidden),
        "gate_up": randn(tokens, 2 * 50),
        "positions": torch.randint(0, 64, (tokens,), generator=g).to(device),
        "q": randn(tokens, 6, 16),
        "k": randn(tokens, 2, 16),
        "cos_sin_cache": kiln.ops.rope_cos_sin_cache(12, 64, device=device),
    }


def _layer(x, residual, weight, bias, gate_up, positions, q, k, cos_sin_cache):
    """A toy block calling every registered op (in-place ones included)."""
    h = torch.ops.kiln.rms_norm(x, weight, 1e-6, residual)  # residual <- x + residual
    h = torch.ops.kiln.layer_norm(h * 2.0, weight, bias, 1e-5)
    torch.ops.kiln.rotary_embedding(positions, q, k, cos_sin_cache, True)
    torch.ops.kiln.rotary_embedding(positions, q, k, cos_sin_cache, False)
    probs = torch.ops.kiln.softmax(h, 0.8)
    act = torch.ops.kiln.silu_and_mul(gate_up) + torch.ops.kiln.gelu_tanh_and_mul(gate_up)
    return probs, act, torch.ops.kiln.rms_norm(residual, weight, 1e-6, None), q * 1.0, k * 1.0


def _eager_layer(x, residual, weight, bias, gate_up, positions, q, k, cos_sin_cache):
    """The same block through the plain kiln.ops functions."""
    h, residual = kiln.ops.rms_norm(x, weight, 1e-6, residual)
    h = kiln.ops.layer_norm(h * 2.0, weight, bias, 1e-5)
    kiln.ops.rotary_embedding(positions, q, k, cos_sin_cache, True)
    kiln.ops.rotary_embedding(positions, q, k, cos_sin_cache, False)
    probs = kiln.ops.softmax(h, 0.8)
    act = kiln.ops.silu_and_mul(gate_up) + kiln.ops.gelu_tanh_and_mul(gate_up)
    return probs, act, kiln.ops.rms_norm(residual, weight, 1e-6), q * 1.0, k * 1.0


def test_every_registered_op_is_reachable_under_torch_ops_kiln():
    for name in REGISTERED:
        assert hasattr(torch.ops.kiln, name), name
    schema = str(torch.ops.kiln.rotary_embedding.default._schema)
    assert "Tensor(a1!) q" in schema and "Tensor(a2!) k" in schema  # declared as mutated


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_custom_ops_match_the_plain_functions_and_mutate_the_same_tensors(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    ops_inputs, eager_inputs = _inputs(device), _inputs(device)
    got = _layer(**ops_inputs)
    want = _eager_layer(**eager_inputs)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, 1e-6)
    for name in ("residual", "q", "k"):
        assert_close(ops_inputs[name], eager_inputs[name], 1e-6, name)
    assert not torch.equal(ops_inputs["residual"], _inputs(device)["residual"])  # it was updated


def test_torch_compile_fullgraph_traces_through_the_custom_ops():
    torch._dynamo.reset()
    compiled = torch.compile(_layer, fullgraph=True, backend="aot_eager")
    compiled_inputs, eager_inputs = _inputs("cpu"), _inputs("cpu")
    got = compiled(**compiled_inputs)  # fullgraph=True: any graph break raises here
    want = _eager_layer(**eager_inputs)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, 1e-6)
    # The mutations of residual, q and k survive functionalization.
    for name in ("residual", "q", "k"):
        assert_close(compiled_inputs[name], eager_inputs[name], 1e-6, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_tensor_run_gives_the_right_shapes_and_dtypes(dtype):
    with FakeTensorMode():
        inputs = {
            "x": torch.empty(7, 3, 576, dtype=dtype),
            "weight": torch.empty(576, dtype=dtype),
            "gate_up": torch.empty(7, 3, 2 * 1536, dtype=dtype),
            "positions": torch.empty(7, dtype=torch.int64),
            "q": torch.empty(7, 9, 64, dtype=dtype),
            "k": torch.empty(7, 3, 64, dtype=dtype),
            "cache": torch.empty(4096, 64, dtype=torch.float32),
        }
        norm = torch.ops.kiln.rms_norm(inputs["x"], inputs["weight"], 1e-6, None)
        layer_normed = torch.ops.kiln.layer_norm(inputs["x"], inputs["weight"], None, 1e-5)
        probs = torch.ops.kiln.softmax(inputs["x"], 1.0)
        silu = torch.ops.kiln.silu_and_mul(inputs["gate_up"])
        gelu = torch.ops.kiln.gelu_tanh_and_mul(inputs["gate_up"])
        rope = torch.ops.kiln.rotary_embedding(
            inputs["positions"], inputs["q"], inputs["k"], inputs["cache"], True
        )
    for out in (norm, layer_normed, probs):
        assert out.shape == (7, 3, 576) and out.dtype == dtype
    for out in (silu, gelu):
        assert out.shape == (7, 3, 1536) and out.dtype == dtype
    assert rope is None


def test_fake_implementations_validate_like_the_real_ops():
    with FakeTensorMode(), pytest.raises(ValueError, match="silu_and_mul: x has last dim 7"):
        torch.ops.kiln.silu_and_mul(torch.empty(3, 7))
    with FakeTensorMode(), pytest.raises(ValueError, match="rms_norm: weight has last dim 5"):
        torch.ops.kiln.rms_norm(torch.empty(3, 8), torch.empty(5), 1e-6, None)


@pytest.mark.parametrize("name", REGISTERED)
def test_opcheck_schema_fake_and_dispatch_registrations(name):
    inputs = _inputs("cpu")
    args = {
        "rms_norm": (inputs["x"], inputs["weight"], 1e-6, inputs["residual"]),
        "layer_norm": (inputs["x"], inputs["weight"], inputs["bias"], 1e-5),
        "softmax": (inputs["x"], 0.7),
        "silu_and_mul": (inputs["gate_up"],),
        "gelu_tanh_and_mul": (inputs["gate_up"],),
        "rotary_embedding": (inputs["positions"], inputs["q"], inputs["k"], inputs["cos_sin_cache"], False),
    }[name]
    torch.library.opcheck(getattr(torch.ops.kiln, name).default, args)


# Compiles each kernel variant (bf16, the GPU dtype) ahead of time for sm_90, no GPU needed, in a
# fresh process where TRITON_INTERPRET is unset. The interpreter accepts things the compiler
# rejects (non-constexpr globals, if/else merging a constexpr-specialized int with a runtime int).
_AOT_SCRIPT = textwrap.dedent(
    """
    import importlib
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    def build(family, kernel, signature, constexprs, module="triton"):
        fn = getattr(importlib.import_module(f"kiln.ops.{family}.{module}"), kernel)
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compile(source, target=GPUTarget("cuda", 90, 32))

    bf16, i32 = "*bf16", "i32"
    rows = {"x_row_stride": i32, "out_row_stride": i32}
    for single in (True, False):
        build("softmax.softmax", "_softmax_kernel",
              {"x_ptr": bf16, "out_ptr": bf16, **rows, "n_cols": i32, "inv_temperature": "fp32"},
              {"BLOCK_N": 1024, "SINGLE_BLOCK": single})
        build("norm.layer_norm", "_layer_norm_kernel",
              {"x_ptr": bf16, "weight_ptr": bf16, "bias_ptr": bf16, "out_ptr": bf16, **rows,
               "n_cols": i32, "eps": "fp32"},
              {"HAS_BIAS": single, "BLOCK_N": 1024, "SINGLE_BLOCK": single})
        build("norm.rms_norm", "_rms_norm_kernel",
              {"x_ptr": bf16, "residual_ptr": bf16, "weight_ptr": bf16, "out_ptr": bf16, **rows,
               "residual_row_stride": i32, "n_cols": i32, "eps": "fp32", "weight_offset": "fp32"},
              {"HAS_RESIDUAL": single, "BLOCK_N": 1024, "SINGLE_BLOCK": single})
        build("rope.rotary_embedding", "_rotary_kernel",
              {"positions_ptr": "*i64", "q_ptr": bf16, "k_ptr": bf16, "cache_ptr": "*fp32",
               "q_token_stride": i32, "q_head_stride": i32, "k_token_stride": i32, "k_head_stride": i32,
               "cache_stride": i32, "n_k_heads": i32, "half_rotary": i32},
              {"n_q_heads": 1, "IS_NEOX": single, "BLOCK_H": 16, "BLOCK_R": 64})  # 1 q head: specialized
    for activation in ("silu", "gelu_tanh"):  # both ops' kernel: ops/activation/gated_triton.py
        build("activation", "_gated_kernel", {"x_ptr": bf16, "out_ptr": bf16, **rows, "d": i32},
              {"ACTIVATION": activation, "BLOCK_D": 1024}, module="gated_triton")
    print("compiled")
    """
)


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
