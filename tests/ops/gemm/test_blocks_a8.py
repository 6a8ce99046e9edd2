"""The "q4_blocks_a8" / "q8_blocks_a8" CPU formats: the exact formats' GGUF blocks, with a one-row x
quantized to Q8_0 first and integer block dot products (kiln.ops.gemm.cpu_blocks_a8, llama.cpp's CPU
arithmetic; K-quant weights get the "kquants_a8" layout instead, x to Q8_K on the file's blocks,
kiln.ops.gemm.cpu_kquants_a8, tested in test_kquants_a8.py, except where that kernel is missing).
References not written by Kiln: the `gguf` package writes the weights' blocks and is the activation
quantizer the kernels must agree with, value for value."""

import random

import numpy as np
import pytest
import torch

import kiln.ops
from kiln.ops.gemm import cpu_blocks_a8 as a8
from kiln.ops.gemm import cpu_kquants_a8 as kquants
from kiln.ops.gemm.prepared_linear.spec import prepared_linear_reference
from kiln.ops.gemm.weight_formats import prepare_linear_weight, prepared_matrix
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFStackedWeight, GGUFWeight
from kiln.verify import assert_close
from tests.ops.gemm.native_gemv_child import assert_compiled_call_holds_native_op

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")
FORMATS = {"q4_blocks_a8": ("Q4_1", "Q4_0"), "q8_blocks_a8": ("Q8_0",)}


def _weight(qtype: str, n: int, k: int, generator) -> GGUFWeight:
    """Fresh values in GGUF blocks: written by `gguf` (Kiln's packer for the K-quants, which gguf cannot
    write)."""
    values = torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator)
    if qtype.endswith("_K"):
        return GGUFWeight(qtype, quantize_blocks(values, qtype), (n, k))
    kind = gguf.GGMLQuantizationType[qtype]
    return GGUFWeight(qtype, torch.from_numpy(gguf.quants.quantize(values.numpy(), kind)), (n, k))


def _gguf_matrix(weight: GGUFWeight) -> torch.Tensor:
    """The float64 matrix `gguf` dequantizes the weight's blocks to."""
    kind = gguf.GGMLQuantizationType[weight.qtype]
    return torch.from_numpy(gguf.quants.dequantize(weight.data.numpy(), kind)).double().view(weight.shape)


def _gguf_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's Q8_0 of x float32 [M, K]: (int8 values [M, K], float16 scales as float32 [M, K / 32])."""
    m, k = x.shape
    data = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(m, k // 32, 34)
    q = torch.from_numpy(data[..., 2:].copy().view(np.int8)).reshape(m, k)
    d = torch.from_numpy(data[..., :2].copy().view(np.float16).astype(np.float32)).reshape(m, k // 32)
    return q, d


def _gguf_x(x: torch.Tensor) -> torch.Tensor:
    """x float32 [1, K] as the Q8_0-x kernels see it, float64: gguf's Q8_0 values per 32 with the
    float32 scale max|x| / 127."""
    k = x.shape[1]
    blocks = x.float().view(-1, 32)
    data = gguf.quants.Q8_0.quantize_blocks(blocks.numpy())
    q = torch.from_numpy(data[:, 2:].copy().view(np.int8)).double()
    return (q * (blocks.abs().amax(-1, keepdim=True) / 127).double()).view(1, k)


@pytest.fixture(scope="module")
def native():
    if not a8.load():
        pytest.skip("Kiln's native CPU library could not be built here (no C++ compiler or ninja)")


def _prepared(weight, fmt):
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=fmt)
    if prepared.layout != f"{fmt}_onednn":
        pytest.skip(f"{fmt} fell back to {prepared.layout!r} here (no oneDNN float32 packing)")
    return prepared


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "tensor_form"])
def test_quantize_q8_0_gives_gguf_values_ties_included(use_native, monkeypatch):
    if use_native and not a8.load():
        pytest.skip("no native library here")
    if not use_native:
        monkeypatch.setitem(a8._state, "loaded", False)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x = torch.randn(7, 576, generator=g) * torch.rand(7, 1, generator=g) * 5
    x[0, :32] = torch.arange(32) * 0.5 - 7.75  # amax 7.75: x / d lands on many halves (ties)
    x[1, 32:64] = torch.arange(32) - 16.0  # amax 16: 127 / 16 steps
    x[2, 64:96] = 0.0  # an all-zero block: d = 0, q = 0
    q, d = a8.quantize_q8_0(x)
    gq, gd = _gguf_q8_0(x)
    assert q.dtype == torch.int8 and torch.equal(q, gq)
    assert d.dtype == torch.float32 and torch.equal(d, x.view(7, 18, 32).abs().amax(-1) / 127)
    assert torch.equal(d.half().float(), gd)  # gguf keeps the same scale, rounded to float16
    step = d.repeat_interleave(32, 1).double()
    assert ((a8.dequantize_q8_0(q, d).double() - x.double()).abs() <= step * 0.5001).all()  # half a step
    x[3, 100], x[4, 5] = float("nan"), float("inf")
    q, d = a8.quantize_q8_0(x)
    assert torch.isnan(d[3, 3]) and torch.isnan(d[4, 0]) and not q[3, 96:128].any()
    assert torch.isfinite(d[3, :3]).all() and torch.isfinite(d[3, 4:]).all()


@pytest.mark.parametrize("fmt,qtype", [(f, q) for f, qs in FORMATS.items() for q in qs])
def test_a8_formats_keep_the_blocks_and_multiply_the_gguf_quantized_x(fmt, qtype, native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    n, k = 53, 160
    weight = _weight(qtype, n, k, g)
    prepared = _prepared(weight, fmt)
    exact = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=fmt[:9])
    matrix = prepared_matrix(prepared.layout, prepared.tensors)
    assert torch.equal(matrix, prepared_matrix(exact.layout, exact.tensors))  # the same stored weight
    assert prepared.kind == fmt[:9] and prepared.compute_dtype == torch.float32
    assert torch.equal(matrix, _gguf_matrix(weight))
    run, bias = kiln.ops.prepared_linear, torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(1, k, generator=g).to(dtype)
        x_gguf = _gguf_x(x.float())
        y = torch.full((1, n), float("nan"))
        y.copy_(run(x, prepared.layout, prepared.tensors, bias, torch.float32))
        # integer block sums: only the float32 scaling and accumulation round
        assert_close(y, x_gguf @ matrix.T + bias.double(), 1e-6, f"one {dtype} row")
        assert_close(
            y,
            prepared_linear_reference(x, prepared.layout, prepared.tensors, bias, torch.float64),
            1e-6,
            "ref",
        )
        # and x's quantization is what moves it from the exact product: a few tenths of a percent
        error = (y.double() - (x.double() @ matrix.T + bias.double())).norm() / (x.double() @ matrix.T).norm()
        assert 1e-5 < error < 2e-2, f"one {dtype} row: {error}"
    rows = torch.randn(5, k, generator=g)  # several rows: the exact float32 copy
    y = run(rows, prepared.layout, prepared.tensors, bias)
    assert_close(y, rows.double() @ matrix.T + bias.double(), 1e-6, "5 rows")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a8_native_kernels_match_their_tensor_form_and_keep_nan(fmt, native, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    n, k = 129, 1536  # rows past several of the kernels' 16-row tasks, SmolLM2's down_proj K
    tensors = _prepared(_weight(FORMATS[fmt][0], n, k, g), fmt).tensors
    gemv = a8.q4_blocks_a8_gemv if fmt == "q4_blocks_a8" else a8.q8_blocks_a8_gemv
    args = tensors[:3] if fmt == "q4_blocks_a8" else tensors[:2]
    x = torch.randn(1, k, generator=g) * 3
    native_y = gemv(x, *args)
    monkeypatch.setitem(a8._state, "loaded", False)  # as where the library cannot be built
    tensor_y = gemv(x, *args)
    monkeypatch.undo()
    # two float32 results summed in different orders (integer block sums here, the exact float kernel
    # on x' there): Q4_1 at this shape, 120 seeds: median 5.7e-7, max 9.9e-7 (a suite run met 1.09e-6)
    assert_close(native_y, tensor_y.double(), 2e-6, "native against the tensor form")
    x[0, 700] = float("nan")  # one NaN input poisons every output: no row may hide it
    assert torch.isnan(gemv(x, *args)).all()


def test_a8_ops_refuse_malformed_inputs_by_name(native):
    g = torch.Generator().manual_seed(3)
    nibbles, scales, mins, copy, *tiles = _prepared(_weight("Q4_1", 40, 160, g), "q4_blocks_a8").tensors
    values, q8_scales, q8_copy, *q8_tiles = _prepared(_weight("Q8_0", 40, 160, g), "q8_blocks_a8").tensors
    run, x = kiln.ops.prepared_linear, torch.randn(1, 160, generator=g)
    with pytest.raises(ValueError, match=r"q4_blocks_a8_onednn nibbles \[40, 80\], scales \(40, 4\)"):
        run(x, "q4_blocks_a8_onednn", [nibbles, scales[:, :4].contiguous(), mins, copy, *tiles])
    with pytest.raises(ValueError, match=r"weight\[0\].*int8"):
        run(x, "q8_blocks_a8_onednn", [values.to(torch.uint8), q8_scales, q8_copy, *q8_tiles])
    with pytest.raises(ValueError, match=r"x has 96 in-features, the 'q4_blocks_a8_onednn' weight 160"):
        run(torch.randn(1, 96), "q4_blocks_a8_onednn", [nibbles, scales, mins, copy, *tiles])
    ops = torch.ops.kiln_cpu
    with pytest.raises(RuntimeError, match=r"K = 80 must be a multiple of 32"):
        ops.q8_blocks_a8_gemv(torch.randn(1, 80), torch.zeros(40, 80, dtype=torch.int8), q8_scales)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[1, K\]"):
        ops.q4_blocks_a8_gemv(torch.randn(2, 160), nibbles, scales, mins)
    with pytest.raises(RuntimeError, match=r"mins must be float32 \[N, K / 32\] = \[40, 5\]"):
        ops.q4_blocks_a8_gemv(x, nibbles, scales, mins.double())
    with pytest.raises(RuntimeError, match=r"nibbles must be uint8 \[N, K / 2\].*K = 160"):
        ops.q4_blocks_a8_gemv(x, nibbles[:, :40], scales, mins)
    with pytest.raises(ValueError, match=r"quantize_q8_0: x must be \[M, K\] with K a multiple of 32"):
        a8.quantize_q8_0(torch.randn(3, 33))


def test_a8_formats_give_float_weights_the_float32_layouts():
    g = torch.Generator().manual_seed(4)
    for fmt in FORMATS:
        prepared = prepare_linear_weight(
            torch.randn(16, 64, generator=g), device=CPU, dtype=torch.float32, cpu_format=fmt
        )
        assert prepared.layout in ("onednn", "dense") and prepared.compute_dtype == torch.float32


# Either a8 format keeps every GGUF type with a blocks layout in its a8 form, as the exact pair does
# (K-quant sources, plain or stacked, where the "kquants_a8" kernel is missing: test_kquants_a8.py has
# them where it runs). source -> layout (parts of a stacked source joined by "+")
A8_KEEPS = {
    "Q4_1": "q4_blocks_a8_onednn",
    "Q4_K": "q4_blocks_a8_onednn",
    "Q8_0": "q8_blocks_a8_onednn",
    "Q5_0": "q8_blocks_a8_onednn",
    "Q6_K": "q8_blocks_a8_onednn",  # a weight scale per 16
    "Q5_K": "q8_blocks_mins_a8_onednn",
    "Q4_K+Q6_K": "q8_blocks_mins_a8_onednn",  # a scale and a min per 16
    "Q5_K+Q8_0": "q8_blocks_mins_a8_onednn",  # per 32
    "Q6_K+Q8_0": "q8_blocks_a8_onednn",  # per 16, no mins
    "Q5_K+Q6_K": "q8_blocks_mins_a8_onednn",
}


def _source(source: str, n: int, k: int, g):
    """A GGUFWeight, or for "A+B" a GGUFStackedWeight of parts of those types, and its float64 matrix as
    `gguf` decodes the blocks."""
    if "+" not in source:
        weight = _weight(source, n, k, g)
        return weight, _gguf_matrix(weight)
    parts = [_weight(q, n // 2 + i, k, g) for i, q in enumerate(source.split("+"))]
    return GGUFStackedWeight.stack(parts), torch.cat([_gguf_matrix(p) for p in parts])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("source", A8_KEEPS)
def test_a8_formats_keep_every_blocks_type_and_multiply_the_gguf_quantized_x(
    fmt, source, native, monkeypatch
):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    k = 512 if "_K" in source else 160
    weight, matrix = _source(source, 37, k, g)
    monkeypatch.setitem(kquants._state, "loaded", False)  # no K-quant kernel: the Q8_0-x layouts
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=fmt)
    monkeypatch.undo()
    if prepared.layout == "onednn":
        pytest.skip("no oneDNN float32 packing here")
    assert prepared.layout == A8_KEEPS[source] and prepared.kind in ("q4_blocks", "q8_blocks")
    assert torch.equal(prepared_matrix(prepared.layout, prepared.tensors), matrix)
    n, run, bias = matrix.shape[0], kiln.ops.prepared_linear, torch.randn(matrix.shape[0], generator=g)
    x = torch.randn(1, k, generator=g) * 3
    x_gguf = _gguf_x(x)
    y = torch.full((1, n), float("nan"))
    y.copy_(run(x, prepared.layout, prepared.tensors, bias))
    expected = x_gguf @ matrix.T + bias.double()
    assert_close(y, expected, 1e-6, "one row: W @ x' (integer block sums, float32 scaling)")
    error = (y.double() - (x.double() @ matrix.T + bias.double())).norm() / (x.double() @ matrix.T).norm()
    assert 1e-5 < error < 2e-2, f"x's quantization moves it a little: {error}"
    if "mins" in prepared.layout:  # the min terms count: without them the result is far off
        values, scales = prepared.tensors[:2]
        assert (a8.q8_blocks_a8_gemv(x, values, scales) - y + bias).abs().max() > 1e-2 * y.abs().max()
    rows = torch.randn(5, k, generator=g)  # several rows: the exact kernels
    assert_close(
        run(rows, prepared.layout, prepared.tensors, bias),
        rows.double() @ matrix.T + bias.double(),
        1e-6,
        "5 rows",
    )
    monkeypatch.setitem(a8._state, "loaded", False)  # where the library cannot be built: the tensor form
    assert_close(run(x, prepared.layout, prepared.tensors, bias), expected, 1e-6, "tensor form")
    monkeypatch.undo()
    x[0, 70] = float("nan")  # one NaN input poisons every output
    assert torch.isnan(run(x, prepared.layout, prepared.tensors, bias)).all()


def test_the_q8_a8_kernels_refuse_malformed_scales_and_mins_by_name(native):
    g = torch.Generator().manual_seed(5)
    weight, _ = _source("Q4_K+Q6_K", 40, 256, g)
    values, scales, mins = weight.fields()
    x, ops = torch.randn(1, 256, generator=g), torch.ops.kiln_cpu
    with pytest.raises(
        RuntimeError,
        match=r"q8_blocks_a8_gemv: scales must be float32 \[N, K / 32\] = \[41, 8\] or \[N, K / 16\]",
    ):
        ops.q8_blocks_a8_gemv(x, values, scales[:, :5].contiguous())
    with pytest.raises(
        RuntimeError, match=r"q8_blocks_mins_a8_gemv: mins must be float32 \[41, 16\] \(the scales' shape\)"
    ):
        ops.q8_blocks_mins_a8_gemv(x, values, scales, mins[:, :8].contiguous())
    with pytest.raises(RuntimeError, match=r"q8_blocks_mins_a8_gemv: mins must be float32 .*Double"):
        ops.q8_blocks_mins_a8_gemv(x, values, scales, mins.double())


@pytest.mark.parametrize("fmt,qtype", [("q4_blocks_a8", "Q4_1"), ("q8_blocks_a8", "Q8_0")])
def test_a_compiled_step_traced_before_any_eager_call_holds_the_a8_op(fmt, qtype, native):
    setup = f"""
import gguf
from kiln.ops.gemm import cpu_blocks_a8
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight
blocks = gguf.quants.quantize(torch.randn(48, 96).numpy(), gguf.GGMLQuantizationType.{qtype})
weight = GGUFWeight("{qtype}", torch.from_numpy(blocks), (48, 96))
"""
    assert_compiled_call_holds_native_op(setup, fmt, "cpu_blocks_a8.quantize_tensor_form")


def test_the_reference_quantizer_without_gguf_gives_gguf_values(monkeypatch):
    """The GPU image has no `gguf`: there q8_0_reference falls back to the tensor form, which must give
    the same x' (ties and non-finite blocks included)."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x = torch.randn(3, 96, generator=g) * 4
    x[0, :32] = torch.arange(32) * 0.5 - 7.75
    x[1, 40] = float("nan")
    with_gguf = a8.q8_0_reference(x)
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # `from gguf import ...` now fails
    without = a8.q8_0_reference(x)
    assert torch.equal(with_gguf.isnan(), without.isnan()) and with_gguf.isnan()[1, 32:64].all()
    assert torch.equal(with_gguf.nan_to_num(), without.nan_to_num())
