"""The CPU W8A8 layouts (cpu formats "w8a8", "int4_w8a8", "int8_blocks_w8a8"; kiln.ops.gemm.cpu_w8a8):
int8 weights per output channel on Kiln's AMX tile kernel or oneDNN's int8 GEMM, activations quantized
per row by the native op. Every test runs once per kernel this host has ("amx" needs AMX int8 tiles;
"onednn" is what KILN_CPU_AMX=0 and CPUs without AMX get).

Against float64: the reference quantizes x per row and reads the int8 values back from the packing
(fuzz cases in test_prepared_linear); here the stored values themselves, per-row independence (batch
invariance), NaN rows, the hybrids' one-row paths, a compiled graph, and the fallback where the op
cannot run."""

import logging

import pytest
import torch

import kiln.ops
from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_q4_blocks, cpu_q8_blocks, cpu_w8a8, weight_formats
from kiln.ops.gemm.prepared_linear.spec import prepared_linear_reference
from kiln.ops.gemm.weight_formats import exact_rows, prepare_linear_weight, prepared_matrix, w8a8_matrix
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight
from kiln.verify import assert_close

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, params=["amx", "onednn"])
def kernel(request, monkeypatch):
    """Which GEMM pack() lays weights out for: the AMX tiles, or oneDNN's packing (KILN_CPU_AMX=0)."""
    if not cpu_w8a8.load():
        pytest.skip("the native W8A8 op is not available here")
    if request.param not in cpu_w8a8.kernels():
        pytest.skip(f"the {request.param} int8 GEMM does not run here (AMX needs AMX int8 tiles)")
    monkeypatch.setenv("KILN_CPU_AMX", "1" if request.param == "amx" else "0")
    return request.param


def _gguf(qtype, n, k, generator):
    weight = torch.randn(n, k, generator=generator) / 8
    return GGUFWeight(qtype, quantize_blocks(weight, qtype), (n, k))


def test_packed_values_are_the_per_channel_int8_of_the_matrix(kernel):
    g = torch.Generator().manual_seed(1)
    matrix = torch.randn(45, 80, generator=g) * torch.rand(45, 1, generator=g)  # rows of unlike size
    # a transposed view: oneDNN's packing reads memory as [N, K], so pack must make it contiguous
    prepared = prepare_linear_weight(
        matrix.T.contiguous().T, device=CPU, dtype=torch.float32, cpu_format="w8a8"
    )
    assert prepared.layout == "w8a8_packed" and prepared.kind == "w8a8"
    packed, w_scale, zero_point, smooth = prepared.tensors
    assert packed.dim() == (5 if kernel == "amx" else 2)
    assert torch.equal(smooth, torch.ones(80))  # no calibration here
    scale = matrix.abs().amax(1) / 127
    assert torch.equal(w_scale, scale)
    values = torch.round(matrix / scale[:, None]).to(torch.int8)
    assert torch.equal(cpu_w8a8.values(prepared.tensors), values)
    assert not zero_point.any()
    # the stored matrix is within half a step of each channel's scale of the original
    error = (prepared_matrix(prepared.layout, prepared.tensors) - matrix.double()).abs()
    assert bool((error <= scale.double()[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_are_quantized_independently_and_match_float64(out_dtype):
    """Each row's scale is its own: a row 1000x larger beside it changes nothing (bitwise), and every
    row equals the float64 reference of its own quantization."""
    g = torch.Generator().manual_seed(2)
    matrix, bias = torch.randn(70, 96, generator=g), torch.randn(70, generator=g)
    prepared = prepare_linear_weight(matrix, device=CPU, dtype=torch.float32, cpu_format="w8a8")
    x = torch.randn(20, 96, generator=g)  # past one 16-row tile; 70 x 96 pads to 128 x 128 there
    big = torch.cat([x, 1000 * torch.randn(1, 96, generator=g)])
    alone = kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, bias, out_dtype)
    together = kiln.ops.prepared_linear(big, prepared.layout, prepared.tensors, bias, out_dtype)
    assert alone.dtype == out_dtype and torch.equal(together[:20], alone)
    ref = prepared_linear_reference(big.double(), prepared.layout, list(prepared.tensors), bias)
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 1e-3}[out_dtype]
    assert_close(together, ref, tolerance, "w8a8")
    # and within W8A8's rounding of the unquantized product (x and W each to 255 levels)
    assert_close(together, big.double() @ matrix.double().T + bias.double(), 3e-2, "w8a8 vs exact")


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_16bit_activations_match_float64(x_dtype):
    """bf16 / fp16 x (read as they are, no float32 copy first) against the reference; 100 x 70 puts
    one full 64-column group (vector rescale) and a 36-column one (scalar tail) in the output, and
    70 in-features leave the quantizer a tail past its vectors."""
    g = torch.Generator().manual_seed(9)
    matrix, bias = torch.randn(100, 70, generator=g), torch.randn(100, generator=g)
    prepared = prepare_linear_weight(matrix, device=CPU, dtype=torch.float32, cpu_format="w8a8")
    x = torch.randn(19, 70, generator=g).to(x_dtype)
    out = kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, bias, x_dtype)
    ref = prepared_linear_reference(x.double(), prepared.layout, list(prepared.tensors), bias)
    assert out.dtype == x_dtype
    assert_close(out, ref, {torch.bfloat16: 4e-3, torch.float16: 1e-3}[x_dtype], "w8a8 16-bit x")


def test_a_nan_row_stays_nan_and_leaves_the_others_alone():
    g = torch.Generator().manual_seed(3)
    prepared = prepare_linear_weight(torch.randn(40, 64, generator=g), device=CPU, dtype=torch.float32,
                                     cpu_format="w8a8")  # fmt: skip
    x = torch.randn(3, 64, generator=g)
    clean = kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors)
    x[1, 7] = float("nan")
    out = kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors)
    assert out[1].isnan().all()
    assert torch.equal(out[[0, 2]], clean[[0, 2]])


def test_a_zero_row_gives_the_bias():
    g = torch.Generator().manual_seed(4)
    prepared = prepare_linear_weight(torch.randn(40, 64, generator=g), device=CPU, dtype=torch.float32,
                                     cpu_format="w8a8")  # fmt: skip
    bias = torch.randn(40, generator=g)
    out = kiln.ops.prepared_linear(torch.zeros(2, 64), prepared.layout, prepared.tensors, bias)
    assert torch.equal(out, bias.expand(2, 40))


def test_int4_w8a8_runs_int4_at_one_row_and_the_int8_copy_beyond():
    g = torch.Generator().manual_seed(5)
    weight = _gguf("Q4_1", 48, 128, g)
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="int4_w8a8")
    assert prepared.layout == "int4_w8a8_packed" and prepared.kind == "int4"
    assert prepared.compute_dtype == torch.bfloat16
    int4 = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="int4")
    x = torch.randn(1, 128, generator=g)
    assert torch.equal(
        kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors),
        kiln.ops.prepared_linear(x, int4.layout, int4.tensors),
    )
    # the copy is the int4 matrix requantized per channel
    int4_matrix = prepared_matrix(int4.layout, int4.tensors)
    assert torch.equal(prepared_matrix(prepared.layout, prepared.tensors), int4_matrix)
    values, scale = cpu_w8a8.quantize_per_channel(int4_matrix.float())
    assert torch.equal(
        w8a8_matrix(prepared.layout, prepared.tensors), values.double() * scale.double()[:, None]
    )
    rows = torch.randn(6, 128, generator=g)
    out = kiln.ops.prepared_linear(rows, prepared.layout, prepared.tensors)
    ref = prepared_linear_reference(rows.double(), prepared.layout, list(prepared.tensors))
    assert_close(out, ref, 1e-6, "int4_w8a8, 6 rows")


def test_int8_blocks_w8a8_keeps_the_q8_0_values_for_one_row():
    g = torch.Generator().manual_seed(6)
    weight = _gguf("Q8_0", 40, 96, g)
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="int8_blocks_w8a8")
    assert prepared.layout == "int8_blocks_w8a8_packed" and prepared.kind == "int8_blocks"
    values, scales = cpu_q8_blocks.pack(weight)
    assert torch.equal(prepared.tensors[0], values) and torch.equal(prepared.tensors[1], scales)
    x = torch.randn(1, 96, generator=g)
    exact = x.double() @ weight.dequantize(torch.float64).T
    assert_close(kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors), exact, 1e-6, "one row")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_q4_blocks_w8a8_runs_the_exact_blocks_at_one_row_and_an_int8_copy_of_them_beyond(qtype):
    g = torch.Generator().manual_seed(9)
    k = 256 if qtype == "Q4_K" else 96
    weight = _gguf(qtype, 40, k, g)
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="q4_blocks_w8a8")
    assert prepared.layout == "q4_blocks_w8a8_packed" and prepared.kind == "q4_blocks"
    blocks = cpu_q4_blocks.pack(weight)
    assert all(torch.equal(a, b) for a, b in zip(prepared.tensors[:3], blocks, strict=True))
    exact = weight.dequantize(torch.float64)
    assert torch.equal(prepared_matrix(prepared.layout, prepared.tensors), exact)
    x = torch.randn(1, k, generator=g)
    one = kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors)
    assert_close(one, x.double() @ exact.T, 1e-6, "one row")
    q4 = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="q4_blocks")
    assert torch.equal(one, kiln.ops.prepared_linear(x, q4.layout, q4.tensors))  # the same kernel
    # several rows: the blocks' exact matrix (not int4's bf16-rounded one) requantized per channel
    values, scale = cpu_w8a8.quantize_per_channel(exact.float())
    assert torch.equal(
        w8a8_matrix(prepared.layout, prepared.tensors), values.double() * scale.double()[:, None]
    )
    # up to exact_rows rows (unless the copy is AMX tiles, or a scalar build has no row kernel): the
    # blocks' row kernel, exact
    few = exact_rows(prepared.layout, prepared.tensors)
    row_kernel = prepared.tensors[3].dim() != 5 and native_cpu.blocks_gemm_rows() > 1
    assert few == (weight_formats.Q4_W8A8_EXACT_ROWS if row_kernel else 1)
    rows = torch.randn(few + 2, k, generator=g)
    if few > 1:
        out = kiln.ops.prepared_linear(rows[:few], prepared.layout, prepared.tensors)
        assert torch.equal(out, cpu_q4_blocks.q4_blocks_gemm(rows[:few], *blocks))
        assert_close(out, rows[:few].double() @ exact.T, 1e-6, f"{few} rows")
    # more: W8A8 on the int8 copy
    out = kiln.ops.prepared_linear(rows, prepared.layout, prepared.tensors)
    ref = prepared_linear_reference(rows.double(), prepared.layout, list(prepared.tensors))
    assert_close(out, ref, 1e-6, f"q4_blocks_w8a8, {few + 2} rows")
    assert_close(out, rows.double() @ exact.T, 0.05, "q4_blocks_w8a8 against the exact matrix")
    assert not torch.allclose(out.double(), rows.double() @ exact.T, rtol=0, atol=1e-4)  # not the blocks


def test_q4_blocks_w8a8_gives_other_weights_the_plain_w8a8_layout():
    g = torch.Generator().manual_seed(10)
    prepared = prepare_linear_weight(_gguf("Q8_0", 32, 64, g), device=CPU, dtype=torch.float32,
                                     cpu_format="q4_blocks_w8a8")  # fmt: skip
    assert prepared.layout == "w8a8_packed"


def test_q4_blocks_w8a8_is_refused_with_malformed_blocks():
    g = torch.Generator().manual_seed(11)
    prepared = prepare_linear_weight(_gguf("Q4_1", 32, 64, g), device=CPU, dtype=torch.float32,
                                     cpu_format="q4_blocks_w8a8")  # fmt: skip
    bad = list(prepared.tensors)
    bad[1] = bad[1][:, :1]  # one scale a row for two blocks
    with pytest.raises(ValueError, match="q4_blocks_w8a8_packed nibbles"):
        kiln.ops.prepared_linear(torch.randn(1, 64), prepared.layout, bad)
    bad = list(prepared.tensors)
    bad[0] = bad[0].to(torch.int8)
    with pytest.raises(ValueError, match="weight\\[0\\]"):
        kiln.ops.prepared_linear(torch.randn(2, 64), prepared.layout, bad)


def test_amx_tiles_hold_each_value_where_tdpbssd_reads_it():
    """Known answer for to_tiles: element [g, s, j, r, 4c + i] is W[64g + 16j + c, 64s + 4r + i], with the
    padding zero, and values() unpermutes it (runs without AMX: a layout, not the kernel)."""
    n, k = 130, 70  # three column groups, two K steps, both padded
    w = (torch.arange(n * k) % 251 - 125).to(torch.int8).view(n, k)
    tiles = cpu_w8a8.to_tiles(w)
    assert tiles.shape == (3, 2, 4, 16, 64)
    cases = [(0, 0, 0, 0, 0, 0), (0, 0, 1, 2, 3, 1), (1, 1, 3, 0, 15, 3), (2, 0, 0, 15, 1, 2)]
    for g, s, j, r, c, i in cases:
        assert tiles[g, s, j, r, 4 * c + i] == w[64 * g + 16 * j + c, 64 * s + 4 * r + i]
    assert not tiles[2, :, :, :, 8:].any()  # columns 130.. of group 2 (c >= 2)
    assert not tiles[:, 1, :, 2:].any()  # k 72.. of the second step (r >= 2)
    rows = (tiles, torch.ones(n), torch.zeros(n, dtype=torch.int64), torch.ones(k))
    assert torch.equal(cpu_w8a8.values(rows), w)


def test_a_compiled_graph_holds_the_op_and_equals_eager():
    g = torch.Generator().manual_seed(7)
    prepared = prepare_linear_weight(_gguf("Q4_0", 64, 96, g), device=CPU, dtype=torch.float32,
                                     cpu_format="int4_w8a8")  # fmt: skip
    norm = torch.rand(96, generator=g) + 0.5

    def block(h):
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
        return torch.nn.functional.silu(kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors))

    h = torch.randn(5, 96, generator=g)
    with kiln.ops.trusted_inputs():
        compiled = torch.compile(block, fullgraph=True, dynamic=False)(h)
    # inductor fuses the norm and silu (float32 rounding apart, ~1e-6); the int8 GEMM is the same op
    assert_close(compiled, block(h).double(), 1e-5, "compiled vs eager")


def test_unavailable_op_falls_back_to_the_bf16_formats_and_says_so(monkeypatch, caplog):
    monkeypatch.setitem(cpu_w8a8._state, "loaded", False)
    weight_formats._log_w8a8_unavailable.cache_clear()
    g = torch.Generator().manual_seed(8)
    with caplog.at_level(logging.WARNING, logger=weight_formats.__name__):
        plain = prepare_linear_weight(torch.randn(32, 64, generator=g), device=CPU, dtype=torch.float32,
                                      cpu_format="w8a8")  # fmt: skip
        hybrid = prepare_linear_weight(_gguf("Q4_1", 32, 64, g), device=CPU, dtype=torch.float32,
                                       cpu_format="int4_w8a8")  # fmt: skip
        blocks = prepare_linear_weight(_gguf("Q4_1", 32, 64, g), device=CPU, dtype=torch.float32,
                                       cpu_format="q4_blocks_w8a8")  # fmt: skip
    assert "w8a8" not in plain.layout and "w8a8" not in hybrid.layout
    assert hybrid.kind == "int4"
    assert blocks.layout == "q4_blocks_onednn"  # the exact blocks alone
    assert "not available here; using 'bf16'" in caplog.text
    assert "using 'int4_bf16'" in caplog.text
    weight_formats._log_w8a8_unavailable.cache_clear()


def test_bad_inputs_are_refused_by_name():
    prepared = prepare_linear_weight(torch.randn(24, 64), device=CPU, dtype=torch.float32, cpu_format="w8a8")
    with pytest.raises(ValueError, match="x has 63 in-features"):
        kiln.ops.prepared_linear(torch.randn(2, 63), prepared.layout, prepared.tensors)
    with pytest.raises(ValueError, match="bias has 23 elements, expected out-features 24"):
        kiln.ops.prepared_linear(torch.randn(2, 64), prepared.layout, prepared.tensors, torch.randn(23))
    packed, w_scale, zero_point, smooth = prepared.tensors
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"zero points \(23,\), expected \(24,\) as the scales"):
        kiln.ops.prepared_linear(x, prepared.layout, [packed, w_scale, zero_point[:23], smooth])
    with pytest.raises(ValueError, match="weight\\[1\\] has dtype float16"):
        kiln.ops.prepared_linear(x, prepared.layout, [packed, w_scale.half(), zero_point, smooth])
    # AMX tiles pad K to 64 and hold 63 as well as 64: x is what disagrees; oneDNN's copy says [64, 24]
    refused = "x has 64 in-features, the 'w8a8_packed' weight 63|reports \\(64, 24\\)"
    with pytest.raises(ValueError, match=refused):
        kiln.ops.prepared_linear(x, prepared.layout, [packed, w_scale, zero_point, smooth[:63]])
    # scales for more out-features than the copy holds
    wide = torch.ones(100)
    with pytest.raises(ValueError, match="AMX tiles" if packed.dim() == 5 else "int8 copy reports"):
        kiln.ops.prepared_linear(x, prepared.layout, [packed, wide, zero_point.new_zeros(100), smooth])


_ONEDNN_PROBE = """
import torch
from kiln.ops.gemm import cpu_w8a8
assert cpu_w8a8.load()
packed = cpu_w8a8.pack(torch.randn(96, 160))
cpu_w8a8.w8a8_linear(torch.randn(5, 160), *packed, None, torch.float32)
"""


def test_onednn_runs_a_vectorized_int8_matmul_not_its_reference_loop(kernel):
    """int8 activations reach oneDNN's `ref_int8` matmul on CPUs without AMX (~0.1 GFLOP/s, which made
    the W8A8 model test take 50 minutes); the op's uint8 levels with a zero point must not. oneDNN names
    the implementation it ran when ONEDNN_VERBOSE is set."""
    import os
    import subprocess
    import sys

    if kernel != "onednn":
        pytest.skip("the AMX kernel is Kiln's own, not oneDNN's")
    env = dict(os.environ, ONEDNN_VERBOSE="1", KILN_CPU_AMX="0")
    run = subprocess.run([sys.executable, "-c", _ONEDNN_PROBE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    matmuls = [line.split(",")[6] for line in run.stdout.splitlines() if ",exec,cpu,matmul," in line]
    assert matmuls, run.stdout[-2000:]
    assert not any(impl.startswith("ref") for impl in matmuls), matmuls
