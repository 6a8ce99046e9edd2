"""The "q8_blocks" CPU format: GGUF Q8_0 weights kept as their int8 values with a float32 scale per 32
weights (Q6_K's as q - 32 with d * sc per 16), one row through Kiln's native GEMV
(kiln_cpu.q8_blocks_gemv) in float32 on the exact weights, a few through its multi-row kernel, more
through a oneDNN float32 copy. Q8_0 blocks are written by the `gguf` package (Q6_K by Kiln's encoder:
the package has none), and `gguf`'s dequantization is the weights' reference."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_q8_blocks as q8_module
from kiln.ops.gemm import weight_formats
from kiln.ops.gemm.prepared_linear import int8_blocks_gemv
from kiln.ops.gemm.weight_formats import prepare_linear_weight, prepared_matrix
from kiln.quant.gguf_blocks import GGUFStackedWeight, GGUFWeight, quantize_blocks, scale_group
from kiln.verify import assert_close
from tests.ops.gemm.blocks_copy import many_rows, many_rows_matrix
from tests.ops.gemm.native_gemv_child import assert_compiled_call_holds_native_op

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")


def _q8_weight(n: int, k: int, generator, qtype: str = "Q8_0") -> tuple[GGUFWeight, torch.Tensor]:
    """(GGUFWeight, its float64 matrix as `gguf` dequantizes it): rows of unlike size, fresh values,
    uneven sub-block scales."""
    weight = torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator)
    weight = weight * (torch.arange(k) // 16 % 5 + 1)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    if qtype in ("Q8_0", "Q5_0"):
        blocks = torch.from_numpy(gguf.quants.quantize(weight.numpy(), kind))
    else:
        blocks = quantize_blocks(weight, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), kind)).double()
    return GGUFWeight(qtype, blocks, (n, k)), expected


@pytest.fixture(scope="module")
def native():
    if not q8_module.load():
        pytest.skip("Kiln's native CPU library could not be built here (no C++ compiler or ninja)")


def _prepared(weight):
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="q8_blocks")
    if prepared.layout != "q8_blocks_onednn":
        pytest.skip(f"q8_blocks fell back to {prepared.layout!r} here (no oneDNN float32 packing)")
    return prepared


@pytest.mark.parametrize(
    "qtype,n,k",
    [
        ("Q8_0", 37, 96),
        ("Q8_0", 50, 576),
        ("Q8_0", 3, 32),
        ("Q5_0", 23, 160),
        ("Q6_K", 37, 256),
        ("Q6_K", 19, 768),
    ],  # fmt: skip
)
def test_q8_blocks_keeps_the_blocks_exactly_and_runs_one_row_in_float32(qtype, n, k, native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    weight, expected = _q8_weight(n, k, g, qtype)
    prepared = _prepared(weight)
    assert prepared.kind == "q8_blocks" and prepared.compute_dtype == torch.float32
    values, scales, copy, *tiles = prepared.tensors
    group = scale_group(qtype)  # a scale per 32 (Q8_0) or per 16 (Q6_K)
    assert values.dtype == torch.int8 and values.shape == (n, k) and scales.shape == (n, k // group)
    assert qtype != "Q6_K" or all(t.numel() == 0 for t in tiles)  # no tile kernel reads blocks of 16
    matrix = prepared_matrix(prepared.layout, prepared.tensors)
    assert torch.equal(matrix, expected)  # d * q exactly: no rounding of the weight
    assert copy.numel() == (0 if native_cpu.blocks_panel_runs() else n * k)
    read_back = many_rows_matrix(prepared.tensors, 2)  # the copy, or the panel kernel's decode
    assert torch.equal(read_back, expected.float())  # the many-row path: the same matrix in float32
    run, bias = kiln.ops.prepared_linear, torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        one = torch.randn(1, k, generator=g).to(dtype)
        y = torch.full((1, n), float("nan"))
        y.copy_(run(one, prepared.layout, prepared.tensors, bias, torch.float32))
        # float32 arithmetic on the exact weights: only the accumulation rounds (not x, not W)
        assert_close(y, one.double() @ matrix.T + bias.double(), 1e-6, f"one {dtype} row")
    # a few rows (batched decode): q8_blocks_gemm where its multi-row kernel is built (AVX2), the copy
    # elsewhere; past blocks_gemm_rows() and the tile kernel's rows, the panel kernel (or the copy)
    for m in (5, max(native_cpu.blocks_gemm_rows(), native_cpu.blocks_tiles_rows("q8")[1]) + 1):
        rows = torch.randn(m, k, generator=g)
        y = torch.full((m, n), float("nan"))
        y.copy_(run(rows, prepared.layout, prepared.tensors, bias))
        assert_close(y, rows.double() @ matrix.T + bias.double(), 1e-6, f"{m} rows")
    assert torch.equal(y, many_rows(rows, prepared.tensors, 2, bias))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q6_K"])
@pytest.mark.parametrize("m", [2, 3, 4, 5, 9, 19])  # the AVX2 kernel: x rows 8 at a time, W weight rows
def test_q8_blocks_gemm_matches_float64_and_its_tensor_form_row_by_row(m, qtype, native, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    # Q8_0: 17 groups, the prefetch path's odd end; Q6_K: 48 groups of 16; three 16-row tasks
    n, k = 45, 768 if qtype == "Q6_K" else 544
    weight, matrix = _q8_weight(n, k, g, qtype)
    values, scales, *_ = _prepared(weight).tensors
    x = torch.randn(m, k, generator=g)
    y = torch.full((m, n), float("nan"))
    y.copy_(q8_module.q8_blocks_gemm(x, values, scales))
    assert_close(y, x.double() @ matrix.T, 1e-6, f"{m} rows")
    one_row = torch.cat([q8_module.q8_blocks_gemv(x[i : i + 1], values, scales) for i in range(m)])
    assert_close(y, one_row.double(), 1e-6, "against the one-row kernel")
    if native_cpu.blocks_gemm_rows() > 1:  # the multi-row kernel: each row's floats whatever shares the call
        alone = torch.cat([q8_module.q8_blocks_gemm(x[i : i + 1], values, scales) for i in range(m)])
        assert torch.equal(y, alone)
    monkeypatch.setitem(q8_module._state, "loaded", False)  # as where the library cannot be built
    tensor_y = q8_module.q8_blocks_gemm(x, values, scales)
    monkeypatch.undo()
    assert_close(y, tensor_y.double(), 1e-6, "native against tensor form")
    x[m - 1, 7] = float("nan")  # a NaN poisons its own row's outputs, and no other row's
    y = q8_module.q8_blocks_gemm(x, values, scales)
    assert torch.isnan(y[m - 1]).all() and not torch.isnan(y[: m - 1]).any()
    with pytest.raises(RuntimeError, match=r"q8_blocks_gemm: x must be float32 \[M, K\]"):
        torch.ops.kiln_cpu.q8_blocks_gemm(x.double(), values, scales, None)
    with pytest.raises(RuntimeError, match=r"q8_blocks_gemm: values must be int8 \[N, K\] with K = 512"):
        torch.ops.kiln_cpu.q8_blocks_gemm(x[:, :512].contiguous(), values, scales, None)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_q8_blocks_native_kernel_matches_the_compiled_tensor_form_and_keeps_nan(qtype, native, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    n, k = 129, 1536  # rows past several of the kernel's 16-row tasks, SmolLM2's down_proj K
    weight, _ = _q8_weight(n, k, g, qtype)
    values, scales, *_ = _prepared(weight).tensors
    x = torch.randn(1, k, generator=g)
    native_y = int8_blocks_gemv.int8_blocks_gemv(x, values, scales)
    monkeypatch.setitem(q8_module._state, "loaded", False)  # as where the library cannot be built
    tensor_y = int8_blocks_gemv.int8_blocks_gemv(x, values, scales)
    monkeypatch.undo()
    assert_close(native_y, tensor_y.double(), 1e-6, "native against the compiled tensor form")
    x[0, 700] = float("nan")  # one NaN input poisons every output: no row may hide it
    assert torch.isnan(q8_module.q8_blocks_gemv(x, values, scales)).all()


def test_q8_blocks_refuses_malformed_inputs_by_name(native):
    g = torch.Generator().manual_seed(3)
    weight, _ = _q8_weight(40, 160, g)
    values, scales, copy, *tiles = _prepared(weight).tensors
    run, x = kiln.ops.prepared_linear, torch.randn(2, 160, generator=g)
    with pytest.raises(ValueError, match=r"scales \(40, 4\), expected .* scales \(40, 5\) or \(40, 10\)"):
        run(x, "q8_blocks_onednn", [values, scales[:, :4].contiguous(), copy, *tiles])
    with pytest.raises(ValueError, match=r"weight\[0\].*int8"):
        run(x, "q8_blocks_onednn", [values.to(torch.uint8), scales, copy, *tiles])
    bf16_copy = weight_formats.onednn_pack(torch.ones(40, 160, dtype=torch.bfloat16))
    if bf16_copy is not None:  # the float32 copy is this layout's (a bf16 one is int8_blocks')
        with pytest.raises(ValueError, match=r"weight\[2\].*float32"):
            run(x, "q8_blocks_onednn", [values, scales, bf16_copy, *tiles])
    with pytest.raises(ValueError, match=r"x has 96 in-features, the 'q8_blocks_onednn' weight 160"):
        run(torch.randn(1, 96), "q8_blocks_onednn", [values, scales, copy, *tiles])
    op = q8_module.q8_blocks_gemv  # torch.ops.kiln_cpu.q8_blocks_gemv, no mins
    with pytest.raises(RuntimeError, match=r"K = 72 must be a multiple of 16"):
        op(torch.randn(1, 72), torch.zeros(40, 72, dtype=torch.int8), scales)
    with pytest.raises(RuntimeError, match=r"\[N, K / 32\] = \[40, 3\] or \[N, K / 16\] = \[40, 6\]"):
        op(torch.randn(1, 96), torch.zeros(40, 96, dtype=torch.int8), scales)  # 5 scales: neither
    with pytest.raises(RuntimeError, match=r"x must be float32 \[1, K\]"):
        op(torch.randn(2, 160), values, scales)
    with pytest.raises(RuntimeError, match=r"scales must be float32 \[N, K / 32\] = \[40, 5\]"):
        op(torch.randn(1, 160), values, scales.double())


def test_q8_blocks_gives_float_weights_the_float32_layouts():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="q8_blocks")
    assert prepared.layout in ("onednn", "dense") and prepared.compute_dtype == torch.float32


def test_q5_k_keeps_its_values_scales_and_mins_exactly_at_every_row_count(native, monkeypatch):
    """GGUF Q5_K ("q8_blocks_mins_onednn"): q with d * sc and -(dmin * m) per 32, decoded exactly as the
    gguf package does; one row (the Q8 GEMV with the mins), a few (its multi-row kernel with the mins)
    and many (the float32 copy) rows against float64 on that matrix, and the tensor forms where the
    library is missing."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    n, k = 37, 768
    weight, expected = _q8_weight(n, k, g, "Q5_K")
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="q8_blocks")
    if prepared.layout != "q8_blocks_mins_onednn":
        pytest.skip(f"q8_blocks fell back to {prepared.layout!r} here (no oneDNN float32 packing)")
    assert prepared.kind == "q8_blocks" and prepared.compute_dtype == torch.float32
    values, scales, mins, _ = prepared.tensors
    assert values.dtype == torch.int8 and 0 <= int(values.min()) and int(values.max()) <= 31
    assert scales.shape == mins.shape == (n, k // 32)
    matrix = prepared_matrix(prepared.layout, prepared.tensors)
    assert torch.equal(matrix, expected)  # scale * q + min exactly
    run, bias = kiln.ops.prepared_linear, torch.randn(n, generator=g)
    for m in (1, 3, 9, native_cpu.blocks_gemm_rows() + 1):
        x = torch.randn(m, k, generator=g)
        y = torch.full((m, n), float("nan"))
        y.copy_(run(x, prepared.layout, prepared.tensors, bias))
        # one row sums d * sum(x q) and min * sum(x) apart, partly cancelling (the float64 test below):
        # 300 seeds here, median 3.8e-7, max 9.5e-7, and one run of the suite met 1.02e-6
        assert_close(y, x.double() @ matrix.T + bias.double(), 2e-6 if m == 1 else 1e-6, f"{m} rows")
        if m == 1:  # one native call, the mins included (no min term added in Python after it)
            assert torch.equal(y, q8_module.q8_blocks_gemv(x, values, scales, mins).add_(bias))
        elif m <= native_cpu.blocks_gemm_rows():
            assert torch.equal(y, q8_module.q8_blocks_gemm(x, values, scales, mins).add_(bias))
    monkeypatch.setitem(q8_module._state, "loaded", False)  # as where the library cannot be built
    tensor_y = q8_module.q8_blocks_gemm(x[:3], values, scales, mins)
    assert_close(tensor_y, x[:3].double() @ matrix.T, 1e-6, "tensor form")
    # the same cancellation as the native one-row kernel's: 4000 seeds (float32 sums), compiled GEMV
    # median 3.6e-7, max 1.24e-6, 5 over 1e-6; with the bias median 4.9e-7, max 1.31e-6, 19 over 1e-6
    one = int8_blocks_gemv.int8_blocks_gemv(x[:1], values, scales, mins)  # inductor's compiled GEMV
    assert_close(one, x[:1].double() @ matrix.T, 2e-6, "compiled tensor form, one row")
    y = run(x[:1], prepared.layout, prepared.tensors, bias)
    assert_close(y, x[:1].double() @ matrix.T + bias.double(), 2e-6, "prepared_linear without the library")


def _with_mins(source: str, n: int, k: int, g) -> tuple[torch.Tensor, ...]:
    """(values, scales, mins, the float64 matrix as `gguf` decodes it) of a Q5_K weight (a scale and a
    min per 32) or of a stacked one, a Q4_K_M file's QKV: Q4_K rows above Q6_K rows, a scale and a min
    per 16 (GGUFStackedWeight.fields)."""
    if source == "Q5_K":
        weight, matrix = _q8_weight(n, k, g, "Q5_K")
        return (*q8_module.pack_with_mins(weight), matrix)
    parts = [_q8_weight(rows, k, g, qtype) for qtype, rows in (("Q4_K", n - n // 3), ("Q6_K", n // 3))]
    stacked = GGUFStackedWeight.stack([w for w, _ in parts])
    return (*stacked.fields(), torch.cat([matrix for _, matrix in parts]))


@pytest.mark.parametrize("source", ["Q5_K", "Q4_K+Q6_K"])
@pytest.mark.parametrize("n", [37, 45, 129])  # odd: a task's last rows one at a time (and AVX2's 4-row steps)
@pytest.mark.parametrize("m", [1, 3, 9])  # 9: x rows 8 at a time, then one
def test_q8_blocks_kernels_with_mins_match_gguf_float64(m, n, source, native):
    """The native kernels given mins (q8_blocks_gemv for one row, q8_blocks_gemm for any), per 32 (Q5_K)
    or per 16 (a stacked Q4_K + Q6_K weight), against float64 on the gguf package's decode of the same
    blocks: the min term is each block's sum of x times its min (one row) or fma(q, d * sc, min) per
    weight (several), both exact up to float32 sums."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    k = 1280  # 40 blocks of 32 (80 of 16): AVX-512's min_terms takes 16 at a time, then 8 one by one
    values, scales, mins, matrix = _with_mins(source, n, k, g)
    assert scales.shape == mins.shape == (n, k // (32 if source == "Q5_K" else 16))
    x = torch.randn(m, k, generator=g)
    expected = x.double() @ matrix.T
    y = torch.full((m, n), float("nan"))
    y.copy_(q8_module.q8_blocks_gemm(x, values, scales, mins))
    assert_close(y, expected, 1e-6, f"q8_blocks_gemm, {m} rows")
    for i in range(m):
        # one row sums d * sum(x q) and min * sum(x) apart: they partly cancel (q >= 0, min <= 0), so
        # their float32 roundings are a larger part of the result (median 4e-7 over 40 seeds, max 7.5e-7)
        one = q8_module.q8_blocks_gemv(x[i : i + 1], values, scales, mins)
        assert_close(one, expected[i : i + 1], 2e-6, f"q8_blocks_gemv, row {i}")
    if native_cpu.blocks_gemm_rows() > 1:  # the multi-row kernel: each row's floats whatever shares the call
        alone = torch.cat([q8_module.q8_blocks_gemm(x[i : i + 1], values, scales, mins) for i in range(m)])
        assert torch.equal(y, alone)
    without = q8_module.q8_blocks_gemm(x, values, scales)  # the mins change the result (q in 0..31 alone)
    assert (without - y).abs().max() > 1e-3 * y.abs().max()


def test_q8_blocks_kernels_refuse_malformed_mins_by_name(native):
    g = torch.Generator().manual_seed(6)
    weight, _ = _q8_weight(40, 256, g, "Q5_K")
    values, scales, mins = q8_module.pack_with_mins(weight)
    x = torch.randn(2, 256, generator=g)
    for op in (torch.ops.kiln_cpu.q8_blocks_gemv, torch.ops.kiln_cpu.q8_blocks_gemm):
        name, x_in = op._qualified_op_name.split("::")[1], x[:1]
        with pytest.raises(
            RuntimeError, match=rf"{name}: mins must be float32 \[N, K / 16\] = \[40, 16\] \(the"
        ):
            op(x_in, values, torch.rand(40, 16), mins)  # scales per 16, mins per 32
        with pytest.raises(RuntimeError, match=rf"{name}: mins must be float32 \[N, K / 32\] = \[40, 8\]"):
            op(x_in, values, scales, mins[:, :4].contiguous())
        with pytest.raises(RuntimeError, match=rf"{name}: mins must be float32 \[N, K / 32\] = \[40, 8\]"):
            op(x_in, values, scales, mins[:39].contiguous())
        with pytest.raises(RuntimeError, match=rf"{name}: mins must be float32 \[N, K / 32\].*Double"):
            op(x_in, values, scales, mins.double())


@pytest.mark.parametrize("cpu_format", ["q4_blocks", "q8_blocks"])
def test_either_blocks_format_keeps_every_type_it_has_an_exact_layout_for(cpu_format):
    """The probe picks one format for all of a model's layers, whose files mix types (Q4_K_M: Q4_K
    and Q6_K): each blocks format keeps Q4_0 / Q4_1 / Q4_K in "q4_blocks_onednn", Q8_0 / Q5_0 / Q6_K in
    "q8_blocks_onednn" and Q5_K in "q8_blocks_mins_onednn" (where oneDNN packs float32 here)."""
    g = torch.Generator().manual_seed(5)
    q4, q8, q8m = "q4_blocks_onednn", "q8_blocks_onednn", "q8_blocks_mins_onednn"
    kept = (("Q4_1", q4), ("Q4_K", q4), ("Q8_0", q8), ("Q5_0", q8), ("Q6_K", q8), ("Q5_K", q8m))
    for qtype, layout in kept:
        weight = GGUFWeight(qtype, quantize_blocks(torch.randn(32, 256, generator=g), qtype), (32, 256))
        prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=cpu_format)
        assert prepared.layout in (layout, "onednn", "dense"), (qtype, prepared.layout)


def test_a_compiled_step_traced_before_any_eager_call_holds_the_native_op(native):
    setup = """
import gguf
from kiln.ops.gemm.prepared_linear import int8_blocks_gemv
from kiln.quant.gguf_blocks import GGUFWeight, quantize_blocks, scale_group
blocks = gguf.quants.quantize(torch.randn(48, 96).numpy(), gguf.GGMLQuantizationType.Q8_0)
weight = GGUFWeight("Q8_0", torch.from_numpy(blocks), (48, 96))
"""
    assert_compiled_call_holds_native_op(setup, "q8_blocks", "int8_blocks_gemv._gemv")
