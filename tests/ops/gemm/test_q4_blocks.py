"""The "q4_blocks" CPU format: GGUF Q4_0 / Q4_1 / Q4_K weights kept as their 4-bit values with d and m
per 32 weights, one row through Kiln's native GEMV (kiln_cpu.q4_blocks_gemv) in float32 on the exact
weights, several rows through a oneDNN float32 copy. Blocks are written by the `gguf` package (Q4_0,
Q4_1; it cannot quantize Q4_K, so Kiln's packer writes those) and `gguf`'s dequantization is the
weights' reference."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_q4_blocks as q4_module
from kiln.ops.gemm.weight_formats import prepare_linear_weight, prepared_matrix
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight
from kiln.verify import assert_close
from tests.ops.gemm.blocks_copy import many_rows, many_rows_matrix
from tests.ops.gemm.native_gemv_child import assert_compiled_call_holds_native_op

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")


def _q4_weight(qtype: str, n: int, k: int, generator) -> tuple[GGUFWeight, torch.Tensor]:
    """(GGUFWeight, its float64 matrix as `gguf` dequantizes it): rows of unlike size, fresh values."""
    weight = torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    if qtype == "Q4_K":
        blocks = quantize_blocks(weight, qtype)
    else:
        blocks = torch.from_numpy(gguf.quants.quantize(weight.numpy(), kind))
    expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), kind)).double()
    return GGUFWeight(qtype, blocks, (n, k)), expected


@pytest.fixture(scope="module")
def native():
    if not q4_module.load():
        pytest.skip("Kiln's native CPU library could not be built here (no C++ compiler or ninja)")


@pytest.mark.parametrize("qtype,n,k", [("Q4_0", 37, 96), ("Q4_1", 50, 160), ("Q4_K", 19, 512)])
def test_q4_blocks_keeps_the_blocks_exactly_and_runs_one_row_in_float32(qtype, n, k, native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    weight, expected = _q4_weight(qtype, n, k, g)
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="q4_blocks")
    assert prepared.layout == "q4_blocks_onednn" and prepared.kind == "q4_blocks"
    assert prepared.compute_dtype == torch.float32
    nibbles, scales, mins, copy, *_ = prepared.tensors
    assert nibbles.dtype == torch.uint8 and nibbles.shape == (n, k // 2) and scales.shape == (n, k // 32)
    matrix = prepared_matrix(prepared.layout, prepared.tensors)
    assert torch.equal(matrix.float().double(), expected)  # d * q + m, one float32 rounding as gguf's
    read_back = many_rows_matrix(prepared.tensors, 3)  # the copy, or the panel kernel's decode
    assert torch.equal(read_back, expected.float())  # the many-row path: the same float32 matrix
    run, bias = kiln.ops.prepared_linear, torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        one = torch.randn(1, k, generator=g).to(dtype)
        y = torch.full((1, n), float("nan"))
        y.copy_(run(one, prepared.layout, prepared.tensors, bias, torch.float32))
        # float32 arithmetic on the exact weights: only the accumulation rounds (not x, not W)
        assert_close(y, one.double() @ matrix.T + bias.double(), 1e-6, f"{qtype}, one {dtype} row")
    # a few rows (batched decode): q4_blocks_gemm (or the tiles' kernel, test_block_tiles.py) where
    # they are built, the copy elsewhere; past both, the panel kernel on the blocks (vector builds: no
    # copy) or the float32 copy through oneDNN
    for m in (5, max(native_cpu.blocks_gemm_rows(), native_cpu.blocks_tiles_rows("q4")[1]) + 1):
        rows = torch.randn(m, k, generator=g)
        y = torch.full((m, n), float("nan"))
        y.copy_(run(rows, prepared.layout, prepared.tensors, bias))
        assert_close(y, rows.double() @ matrix.T + bias.double(), 1e-6, f"{qtype}, {m} rows")
    assert copy.numel() == (0 if native_cpu.blocks_panel_runs() else n * k)
    assert torch.equal(y, many_rows(rows, prepared.tensors, 3, bias))


def test_q4_blocks_native_kernel_matches_its_tensor_form_and_keeps_nan(native, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    n, k = 129, 1536  # rows past several of the kernel's 16-row tasks, SmolLM2's down_proj K
    weight, _ = _q4_weight("Q4_1", n, k, g)
    nibbles, scales, mins, *_ = prepare_linear_weight(
        weight, device=CPU, dtype=torch.float32, cpu_format="q4_blocks"
    ).tensors
    x = torch.randn(1, k, generator=g)
    native_y = q4_module.q4_blocks_gemv(x, nibbles, scales, mins)
    monkeypatch.setitem(q4_module._state, "loaded", False)  # as where the library cannot be built
    tensor_y = q4_module.q4_blocks_gemv(x, nibbles, scales, mins)
    monkeypatch.undo()
    assert_close(native_y, tensor_y.double(), 1e-6, "native against tensor form")
    x[0, 40] = float("nan")  # one NaN input poisons every output: no row may hide it
    assert torch.isnan(q4_module.q4_blocks_gemv(x, nibbles, scales, mins)).all()


@pytest.mark.parametrize("m", [2, 3, 4, 5, 9, 19])  # the AVX2 kernel: x rows 8 at a time, W weight rows
def test_q4_blocks_gemm_matches_float64_and_its_tensor_form_row_by_row(m, native, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    n, k = 45, 544  # 17 groups: the prefetch and remainder paths, three 16-row tasks
    weight, matrix = _q4_weight("Q4_1", n, k, g)
    nibbles, scales, mins, *_ = prepare_linear_weight(
        weight, device=CPU, dtype=torch.float32, cpu_format="q4_blocks"
    ).tensors
    x = torch.randn(m, k, generator=g)
    y = torch.full((m, n), float("nan"))
    y.copy_(q4_module.q4_blocks_gemm(x, nibbles, scales, mins))
    assert_close(y, x.double() @ matrix.T, 1e-6, f"{m} rows")
    one_row = torch.cat([q4_module.q4_blocks_gemv(x[i : i + 1], nibbles, scales, mins) for i in range(m)])
    assert_close(y, one_row.double(), 1e-6, "against the one-row kernel")
    if native_cpu.blocks_gemm_rows() > 1:  # the multi-row kernel: each row's floats whatever shares the call
        alone = torch.cat([q4_module.q4_blocks_gemm(x[i : i + 1], nibbles, scales, mins) for i in range(m)])
        assert torch.equal(y, alone)
    monkeypatch.setitem(q4_module._state, "loaded", False)  # as where the library cannot be built
    tensor_y = q4_module.q4_blocks_gemm(x, nibbles, scales, mins)
    monkeypatch.undo()
    assert_close(y, tensor_y.double(), 1e-6, "native against tensor form")
    x[m - 1, 7] = float("nan")  # a NaN poisons its own row's outputs, and no other row's
    y = q4_module.q4_blocks_gemm(x, nibbles, scales, mins)
    assert torch.isnan(y[m - 1]).all() and not torch.isnan(y[: m - 1]).any()
    with pytest.raises(RuntimeError, match=r"q4_blocks_gemm: x must be float32 \[M, K\]"):
        torch.ops.kiln_cpu.q4_blocks_gemm(x.double(), nibbles, scales, mins)
    with pytest.raises(RuntimeError, match=r"q4_blocks_gemm: K = 512 must be a multiple of 32 with nibbles"):
        torch.ops.kiln_cpu.q4_blocks_gemm(x[:, :512].contiguous(), nibbles, scales, mins)


def test_q4_blocks_refuses_malformed_inputs_by_name(native):
    g = torch.Generator().manual_seed(3)
    weight, _ = _q4_weight("Q4_1", 40, 160, g)
    nibbles, scales, mins, copy, *tiles = prepare_linear_weight(
        weight, device=CPU, dtype=torch.float32, cpu_format="q4_blocks"
    ).tensors
    run, x = kiln.ops.prepared_linear, torch.randn(2, 160, generator=g)
    with pytest.raises(ValueError, match=r"scales \(40, 4\) and mins \(40, 5\), expected .* \(40, 5\)"):
        run(x, "q4_blocks_onednn", [nibbles, scales[:, :4].contiguous(), mins, copy, *tiles])
    with pytest.raises(ValueError, match=r"weight\[0\].*uint8"):
        run(x, "q4_blocks_onednn", [nibbles.to(torch.int8), scales, mins, copy, *tiles])
    with pytest.raises(ValueError, match=r"x has 96 in-features, the 'q4_blocks_onednn' weight 160"):
        run(torch.randn(1, 96), "q4_blocks_onednn", [nibbles, scales, mins, copy, *tiles])
    op = torch.ops.kiln_cpu.q4_blocks_gemv
    with pytest.raises(RuntimeError, match=r"K = 80 must be a multiple of 32"):
        op(torch.randn(1, 80), torch.zeros(40, 40, dtype=torch.uint8), scales, mins)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[1, K\]"):
        op(torch.randn(2, 160), nibbles, scales, mins)


def test_q4_blocks_gives_float_weights_the_float32_layouts():
    """(GGUF Q8_0, Q5_0, Q6_K and Q5_K weights get "q8_blocks"'s layouts: tests/ops/gemm/test_q8_blocks.py)"""
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="q4_blocks")
    assert prepared.layout in ("onednn", "dense") and prepared.compute_dtype == torch.float32


def test_a_compiled_step_traced_before_any_eager_call_holds_the_native_op(native):
    setup = """
from kiln.ops.gemm import cpu_q4_blocks
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight
weight = GGUFWeight("Q4_1", quantize_blocks(torch.randn(48, 96), "Q4_1"), (48, 96))
"""
    assert_compiled_call_holds_native_op(setup, "q4_blocks", "cpu_q4_blocks._tensor_gemv")
