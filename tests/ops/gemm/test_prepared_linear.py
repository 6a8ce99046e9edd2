"""prepared_linear: the engine's Linear path, one weight layout per device, against float64 from the
matrix each layout stands for (and, for the int4 repacking, from the GGUF blocks it came from)."""

import random

import pytest
import torch

import kiln.ops
from kiln.models.layers.linear import Linear
from kiln.ops.gemm import cpu_w8a8, weight_formats
from kiln.ops.gemm.prepared_linear import PREPARED_LINEAR
from kiln.ops.gemm.prepared_linear.spec import _torch_linear_fp32
from kiln.ops.gemm.weight_formats import prepare_linear_weight, prepared_matrix
from kiln.ops.registry import BaselineNotApplicable
from kiln.quant import dequantize_blocks, quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight
from kiln.verify import assert_close, run_case

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not weight_formats.onednn_available(), reason="no oneDNN in this torch")


def seed() -> int:
    return random.randrange(2**31)


def _gguf(qtype, n=48, k=96, generator=None):
    weight = torch.randn(n, k, generator=generator) / 8
    return GGUFWeight(qtype, quantize_blocks(weight, qtype), (n, k))


def _layouts_made_by_fuzz_shapes(dtype):
    return {
        PREPARED_LINEAR.make_inputs(shape, dtype, CPU, torch.Generator().manual_seed(0))["layout"]
        for shape in PREPARED_LINEAR.fuzz_shapes(random.Random(0))
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_fuzz_case_on_the_cpu_backend_matches_float64(dtype):
    for shape in PREPARED_LINEAR.fuzz_shapes(random.Random(seed())):
        case = run_case(PREPARED_LINEAR, "cpu", shape, dtype, CPU, seed())
        assert case.passed, case


@needs_onednn
def test_the_fuzz_shapes_reach_every_cpu_layout_with_one_and_several_rows():
    shapes = PREPARED_LINEAR.fuzz_shapes(random.Random(0))
    assert _layouts_made_by_fuzz_shapes(torch.float32) >= {"onednn", "fp16_onednn", "int4", "int8_weight"}
    formats = ("fp32", "fp16", "bf16", "int4", "int4_bf16", "int8", "int8_blocks", "q4_blocks", "q8_blocks")
    for fmt in (*formats, "w8a8", "int4_w8a8", "int8_blocks_w8a8", "q4_blocks_w8a8"):
        rows = {s["M"] > 1 for s in shapes if s["format"] == fmt}
        assert rows == {False, True}, fmt
    assert {s["source"] for s in shapes if s["format"] == "int4"} == {"Q4_0", "Q4_1", "Q4_K"}
    if cpu_w8a8.load():
        w8a8_layouts = {"w8a8_packed", "int4_w8a8_packed", "int8_blocks_w8a8_packed", "q4_blocks_w8a8_packed"}
        assert _layouts_made_by_fuzz_shapes(torch.float32) >= w8a8_layouts
    assert _layouts_made_by_fuzz_shapes(torch.float32) >= {"gguf_Q5_K"}  # cpu_format "gguf"
    assert _layouts_made_by_fuzz_shapes(torch.float32) >= {"q4_blocks_onednn", "q8_blocks_onednn"}


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
def test_the_layouts_without_onednn_match_float64(monkeypatch, fmt, rows):
    monkeypatch.setattr(weight_formats, "onednn_pack", lambda weight: None)
    shape = {"M": rows, "N": 37, "K": 53, "format": fmt, "source": "float", "bias": True}
    case = run_case(PREPARED_LINEAR, "cpu", shape, torch.float32, CPU, seed())
    assert case.passed, case
    prepared = prepare_linear_weight(torch.randn(37, 53), device=CPU, dtype=torch.float32, cpu_format=fmt)
    assert prepared.layout == {"fp32": "dense", "fp16": "fp16_rows"}[fmt]


@needs_onednn
@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_a_onednn_packed_weight_reads_back_exactly(fmt):
    weight = torch.randn(40, 72)
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=fmt)
    if prepared.layout != "onednn":
        pytest.skip("oneDNN cannot pack bf16 on this CPU")
    stored = weight.to(weight_formats.FORMAT_DTYPES[fmt]).double()
    assert torch.equal(prepared_matrix(prepared.layout, prepared.tensors), stored)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_holds_the_gguf_nibbles_with_bf16_scales_and_zeros(qtype):
    gguf = _gguf(qtype, generator=torch.Generator().manual_seed(1))
    prepared = prepare_linear_weight(gguf, device=CPU, dtype=torch.float32, cpu_format="int4")
    assert prepared.layout == "int4" and prepared.compute_dtype == torch.bfloat16
    # w = d * q + m = (q - 8) * d + (m + 8d), the scale and zero rounded to bf16 once (the kernel's dtype)
    d, m = gguf.scales_and_mins()
    scale = d.bfloat16().double().repeat_interleave(32, 1)
    zero = (m + 8.0 * d).bfloat16().double().repeat_interleave(32, 1)
    expected = (gguf.nibbles().double() - 8.0) * scale + zero
    assert torch.equal(prepared_matrix(prepared.layout, prepared.tensors), expected)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_output_matches_float64_from_the_gguf_blocks(qtype, rows):
    g = torch.Generator().manual_seed(2)
    gguf = _gguf(qtype, generator=g)
    prepared = prepare_linear_weight(gguf, device=CPU, dtype=torch.float32, cpu_format="int4")
    x, bias = torch.randn(rows, 96, generator=g), torch.randn(48, generator=g)
    y = kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, bias)
    ref = x.double() @ dequantize_blocks(gguf.data, qtype, torch.float64).T + bias.double()
    # bf16 activations, scales, zeros and output: each 2^-9 relative (GEMM_TOLERANCE's bf16 bound)
    assert y.dtype == torch.float32
    assert_close(y, ref, 1.6e-2, f"int4 from {qtype}, {rows} rows")


def _packs_bf16() -> bool:
    return weight_formats.onednn_pack(torch.ones(16, 32, dtype=torch.bfloat16)) is not None


@pytest.mark.skipif(not _packs_bf16(), reason="oneDNN cannot pack bf16 on this CPU")
def test_int4_bf16_runs_int4_at_one_row_and_a_bf16_copy_of_the_same_matrix_beyond():
    g = torch.Generator().manual_seed(3)
    gguf = _gguf("Q4_1", generator=g)
    int4 = prepare_linear_weight(gguf, device=CPU, dtype=torch.float32, cpu_format="int4")
    both = prepare_linear_weight(gguf, device=CPU, dtype=torch.float32, cpu_format="int4_bf16")
    assert both.layout == "int4_onednn" and both.kind == "int4" and both.compute_dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(both.tensors[:2], int4.tensors, strict=True))
    matrix = prepared_matrix(both.layout, both.tensors)
    assert torch.equal(matrix, prepared_matrix(int4.layout, int4.tensors))
    # the copy reads back (through oneDNN on an identity) as that matrix rounded to bf16, exactly
    copy = weight_formats.onednn_linear(torch.eye(96, dtype=torch.bfloat16), both.tensors[2], None).T
    assert torch.equal(copy, matrix.to(torch.bfloat16))
    bias = torch.randn(48, generator=g)
    one = torch.randn(1, 96, generator=g)
    run = kiln.ops.prepared_linear
    assert torch.equal(run(one, both.layout, both.tensors, bias), run(one, int4.layout, int4.tensors, bias))
    rows = torch.randn(5, 96, generator=g)
    y = run(rows, both.layout, both.tensors, bias)
    on_copy = weight_formats.onednn_linear(rows.bfloat16(), both.tensors[2], None).float() + bias
    assert torch.equal(y, on_copy)
    assert_close(y, rows.double() @ matrix.T + bias.double(), 1.6e-2, "int4_bf16, 5 rows")
    # a copy of another matrix is refused by name, not left to oneDNN's primitive error
    other = weight_formats.onednn_pack(torch.ones(32, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"int4_onednn copy has shape \(32, 96\), expected \(48, 96\)"):
        run(rows, both.layout, [*both.tensors[:2], other], bias)
    # a weight int4 cannot pack (Q8_0) gets the bf16 layout
    q8 = prepare_linear_weight(
        _gguf("Q8_0", generator=g), device=CPU, dtype=torch.float32, cpu_format="int4_bf16"
    )
    assert q8.layout == "onednn" and q8.compute_dtype == torch.bfloat16


@pytest.mark.skipif(not _packs_bf16(), reason="oneDNN cannot pack bf16 on this CPU")
def test_int8_blocks_keeps_q8_0_values_exactly_runs_one_row_in_float32_and_rows_on_a_bf16_copy():
    import gguf

    g = torch.Generator().manual_seed(5)
    n, k = 40, 160
    weight = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)).numpy()  # rows of unlike size
    blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)  # the file's bytes, by gguf
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)).double()
    q8 = GGUFWeight("Q8_0", torch.from_numpy(blocks), (n, k))
    prepared = prepare_linear_weight(q8, device=CPU, dtype=torch.float32, cpu_format="int8_blocks")
    assert prepared.layout == "int8_blocks_onednn" and prepared.kind == "int8_blocks"
    values, scales, copy = prepared.tensors
    assert values.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (n, k // 32)
    matrix = prepared_matrix(prepared.layout, prepared.tensors)
    assert torch.equal(matrix, expected)  # d * q exactly: no rounding of the weight
    read_back = weight_formats.onednn_linear(torch.eye(k, dtype=torch.bfloat16), copy, None).T
    assert torch.equal(read_back, expected.to(torch.bfloat16))  # the copy: that matrix in bf16
    run, bias = kiln.ops.prepared_linear, torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        one = torch.randn(1, k, generator=g).to(dtype)
        y = run(one, prepared.layout, prepared.tensors, bias, torch.float32)
        # float32 arithmetic on the exact values: only the accumulation rounds (not x, not W)
        assert_close(y, one.double() @ expected.T + bias.double(), 1e-6, f"one {dtype} row")
    rows = torch.randn(5, k, generator=g)
    y = run(rows, prepared.layout, prepared.tensors, bias)
    assert torch.equal(y, weight_formats.onednn_linear(rows.bfloat16(), copy, None).float() + bias)
    assert_close(y, rows.double() @ expected.T + bias.double(), 1.6e-2, "int8_blocks, 5 rows")
    # a weight that is not Q8_0 gets the bf16 layout
    q4 = prepare_linear_weight(
        _gguf("Q4_1", generator=g), device=CPU, dtype=torch.float32, cpu_format="int8_blocks"
    )
    assert q4.layout == "onednn" and q4.compute_dtype == torch.bfloat16
    # malformed tensors are refused by name
    with pytest.raises(
        ValueError, match=r"scales \(40, 4\), expected in-features a multiple of 32 and scales \(40, 5\)"
    ):
        run(rows, prepared.layout, [values, scales[:, :4].contiguous(), copy])
    other = weight_formats.onednn_pack(torch.ones(32, k, dtype=torch.bfloat16))
    with pytest.raises(
        ValueError, match=r"int8_blocks_onednn copy has shape \(32, 160\), expected \(40, 160\)"
    ):
        run(rows, prepared.layout, [values, scales, other])


@pytest.mark.skipif(not _packs_bf16(), reason="oneDNN cannot pack bf16 on this CPU")
def test_int8_blocks_one_row_traced_into_a_compiled_graph_equals_eager():
    """The decode step compiles its forward: there the GEMV is traced into the caller's graph, behind
    an opaque copy of x (else inductor recomputes x's producer per output row)."""
    g = torch.Generator().manual_seed(6)
    prepared = prepare_linear_weight(
        _gguf("Q8_0", n=64, k=128, generator=g), device=CPU, dtype=torch.float32, cpu_format="int8_blocks"
    )
    norm = torch.rand(128, generator=g) + 0.5

    def head(h):
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
        return kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors)

    h = torch.randn(1, 128, generator=g)
    compiled = torch.compile(head, fullgraph=True, dynamic=False)(h)
    matrix = prepared_matrix(prepared.layout, prepared.tensors)
    x = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()
    assert_close(compiled, x @ matrix.T, 1e-6, "compiled")
    assert_close(compiled, head(h).double(), 1e-6, "compiled vs eager")


def test_int8_stores_per_channel_values_with_bf16_scales_and_runs_them():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 96, generator=g) * torch.rand(37, 1, generator=g)  # rows of unlike size
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="int8")
    assert prepared.layout == "int8_weight" and prepared.compute_dtype == torch.bfloat16
    values, scales = prepared.tensors
    assert values.dtype == torch.int8 and scales.dtype == torch.bfloat16 and values.abs().max() <= 127
    # each row's largest value lands on (or, when the bf16 scale rounded down, clips to) +-127
    assert (values.abs().amax(dim=1) == 127).all()
    # the stored values are the nearest steps of the bf16 scale (a clipped one within 2^-8 of its row max)
    matrix = prepared_matrix(prepared.layout, prepared.tensors)
    step = scales.double()[:, None]
    assert ((matrix - weight.double()).abs() <= step / 2 + weight.abs().amax(1, keepdim=True) * 2**-8).all()
    x, bias = torch.randn(5, 96, generator=g), torch.randn(37, generator=g)
    y = kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, bias)
    assert_close(y, x.double() @ matrix.T + bias.double(), 1.6e-2, "int8_weight, 5 rows")


def test_int8_gives_a_row_the_same_values_alone_and_among_other_rows():
    """The "int8" format runs torch's int8 CPU matmul for every row count, so a row's output does not
    depend on the rows beside it, bit for bit (measured on SmolLM2's shapes up to its 49152-row head and
    130 rows; here its gate/up matrix's 1536 x 576). Speculative decoding's verify step and plain decoding
    part under "int8" because its bf16 rounding magnifies float32 differences elsewhere (README,
    "Formats that round activations to 16 bits"), not in this kernel."""
    g = torch.Generator().manual_seed(seed())
    weight = torch.randn(1536, 576, generator=g) / 24
    bias = torch.randn(1536, generator=g)
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="int8")
    assert prepared.layout == "int8_weight"

    def linear(x, row_bias):
        return kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, row_bias)

    x = torch.randn(33, 576, generator=g) * 3
    for row_bias in (None, bias):
        alone = [linear(x[i : i + 1], row_bias) for i in range(3)]
        for rows in (2, 3, 4, 5, 8, 17, 33):
            batch = linear(x[:rows], row_bias)
            for i in range(min(rows, 3)):
                assert torch.equal(batch[i : i + 1], alone[i]), (rows, i)


def test_int8_keeps_in_features_the_kernel_cannot_take_in_fp16_and_refuses_them_by_name():
    odd = prepare_linear_weight(torch.randn(8, 40), device=CPU, dtype=torch.float32, cpu_format="int8")
    assert odd.layout in ("fp16_onednn", "fp16_rows")
    values = torch.ones(8, 40, dtype=torch.int8)
    with pytest.raises(ValueError, match="in-features 40 are not a multiple of 16"):
        kiln.ops.prepared_linear(torch.randn(2, 40), "int8_weight", [values, torch.ones(8).bfloat16()])


@pytest.mark.parametrize(
    "fmt, source",
    [
        ("fp32", "float"),
        ("fp16", "float"),
        ("bf16", "float"),
        ("int4", "Q4_1"),
        ("int4_bf16", "Q4_1"),
        ("int8", "Q4_1"),
        ("int8_blocks", "Q8_0"),
        ("w8a8", "float"),
        ("int4_w8a8", "Q4_1"),
        ("int8_blocks_w8a8", "Q8_0"),
        ("q4_blocks_w8a8", "Q4_1"),
        ("q4_blocks", "Q4_1"),
        ("q8_blocks", "Q8_0"),
    ],
)
def test_zero_rows_give_an_empty_result(fmt, source):
    inputs = PREPARED_LINEAR.make_inputs(
        {"M": 0, "N": 32, "K": 64, "format": fmt, "source": source, "bias": True},
        torch.float32,
        CPU,
        torch.Generator().manual_seed(0),
    )
    assert kiln.ops.prepared_linear(**inputs).shape == (0, 32)


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int4"])
def test_linear_forward_is_the_public_op_and_trusted_calls_skip_validation(monkeypatch, fmt):
    layer = Linear(_gguf("Q4_1"), torch.randn(48), device=CPU, dtype=torch.float32, cpu_format=fmt)
    x = torch.randn(3, 96)
    prepared = layer.prepared
    expected = kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, layer.bias, torch.float16)

    def refuse(*args):
        raise AssertionError("validated inside trusted_inputs()")

    monkeypatch.setattr(PREPARED_LINEAR, "validate", refuse)
    with kiln.ops.trusted_inputs():
        assert torch.equal(layer(x, out_dtype=torch.float16), expected)
    with pytest.raises(AssertionError, match="validated"):
        layer(x)


def test_arguments_are_validated_naming_the_problem():
    prepared = prepare_linear_weight(torch.randn(24, 64), device=CPU, dtype=torch.float32, cpu_format="fp16")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="unknown layout 'packed'"):
        kiln.ops.prepared_linear(x, "packed", prepared.tensors)
    with pytest.raises(ValueError, match="holds 2 tensors, got 1"):
        kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors[:1])
    with pytest.raises(ValueError, match="x has 63 in-features"):
        kiln.ops.prepared_linear(torch.randn(2, 63), prepared.layout, prepared.tensors)
    with pytest.raises(ValueError, match="bias has dtype float32"):  # fp16 layouts keep an fp16 bias
        kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, torch.randn(24))
    with pytest.raises(ValueError, match="bias has 23 elements"):
        kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, torch.randn(23).half())
    with pytest.raises(ValueError, match="x must have 2 dims"):
        kiln.ops.prepared_linear(x[None], prepared.layout, prepared.tensors)


def test_unknown_cpu_format_is_refused_at_prepare():
    with pytest.raises(ValueError, match="cpu_format 'int2'"):
        prepare_linear_weight(torch.randn(8, 8), device=CPU, dtype=torch.float32, cpu_format="int2")


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int4"])
def test_custom_op_schema_and_fake_pass_opcheck(monkeypatch, fmt):
    # oneDNN's opaque tensors have no fake counterpart: opcheck the plain and int4 layouts
    monkeypatch.setattr(weight_formats, "onednn_pack", lambda weight: None)
    prepared = prepare_linear_weight(_gguf("Q4_0"), device=CPU, dtype=torch.float32, cpu_format=fmt)
    args = (torch.randn(3, 96), prepared.layout, list(prepared.tensors), None, torch.float32)
    torch.library.opcheck(torch.ops.kiln.prepared_linear.default, args)


def test_the_bench_baseline_is_f_linear_on_the_float32_matrix():
    shape = {"M": 4, "N": 48, "K": 64, "format": "int4", "source": "Q4_1", "bias": True}
    inputs = PREPARED_LINEAR.make_inputs(shape, torch.float32, CPU, torch.Generator().manual_seed(0))
    ref = PREPARED_LINEAR.reference(**inputs)
    assert_close(_torch_linear_fp32(**inputs), ref, 1.6e-2, "baseline")  # GGUF weights, not bf16 scales
    assert set(PREPARED_LINEAR.baselines) == {"torch_linear_fp32", "gguf_linear_blocks", "torch_bf16_matmul"}
    # the GGUF ones are CUDA layouts' comparisons: for a CPU layout they do not apply (left out)
    for name in ("gguf_linear_blocks", "torch_bf16_matmul"):
        with pytest.raises(BaselineNotApplicable):
            PREPARED_LINEAR.baselines[name](**inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0"])
def test_gguf_blocks_become_planes_on_cuda_and_match_float64(qtype):
    cuda = torch.device("cuda")
    k = 256 if qtype.endswith("_K") else 96
    prepared = prepare_linear_weight(_gguf(qtype, k=k), device=cuda, dtype=torch.float32, cpu_format="int4")
    assert prepared.layout == f"gguf_planar_{qtype}" and prepared.kind == "gguf"
    for rows in (1, 7):
        shape = {"M": rows, "N": 48, "K": k, "format": "fp32", "source": qtype, "bias": True}
        case = run_case(PREPARED_LINEAR, "triton", shape, torch.float32, cuda, seed())
        assert case.passed, case


# What preparing a weight costs, as relative-norm error of the matrix each layout multiplies against
# the checkpoint's (the GGUF blocks dequantized, or the float matrix): `kiln verify` checks each
# kernel against its own prepared matrix, so a format's loss is stated and bounded here. Measured on
# the fuzz shapes: fp16 2.1e-4, bf16 1.7e-3, int4's bf16 scales and zeros 2.9e-3, int8 per channel
# 6.6e-3 of a float matrix and 1.2e-2 re-quantizing a Q4 one, the W8A8 formats' int8 copy (several
# rows) 1.4e-2; the checkpoint formats' float32 products of values and scales ~2e-8; the rest exact.
PREPARATION_ERROR = {
    "fp16": 5e-4, "bf16": 4e-3, "int4": 6e-3, "int4_bf16": 6e-3, "int4_w8a8": 6e-3, "int8": 2e-2,
}  # fmt: skip
W8A8_COPY_ERROR = 2e-2


def _falls_back_to_bf16_here(fmt: str) -> bool:
    """Whether `fmt` prepares to a plain bf16 matrix on this CPU by its documented fallbacks (an AVX2-only
    CPU: no int8 GEMM for the W8A8 formats, and oneDNN packs no bf16 for "int8_blocks"'s copy)."""
    from kiln.ops.gemm import cpu_w8a8
    from kiln.ops.gemm.weight_formats import W8A8_FALLBACK, onednn_packs_bf16

    if not cpu_w8a8.load():
        fmt = W8A8_FALLBACK.get(fmt, fmt)
    return fmt == "bf16" or (fmt == "int8_blocks" and not onednn_packs_bf16())


def test_each_formats_prepared_matrix_against_the_checkpoints_within_its_stated_loss():
    from kiln.ops.gemm.prepared_linear.spec import _BASELINE_MATRICES
    from kiln.ops.gemm.weight_formats import W8A8_COPY_AT, w8a8_matrix

    worst: dict[str, float] = {}
    for shape in PREPARED_LINEAR.fuzz_shapes(random.Random(seed())):
        inputs = PREPARED_LINEAR.make_inputs(shape, torch.float32, CPU, torch.Generator().manual_seed(seed()))
        layout, weight = inputs["layout"], inputs["weight"]
        source = _BASELINE_MATRICES[id(weight[0])].double()
        fmt = shape["format"]
        matrix = prepared_matrix(layout, weight, shape["K"])
        # (a W8A8 format over a matrix its blocks kernels cannot take prepares to the plain int8 copy)
        bound = W8A8_COPY_ERROR if layout == "w8a8_packed" else PREPARATION_ERROR.get(fmt, 1e-6)
        if layout == "dense" and fmt not in PREPARATION_ERROR and weight[0].dtype == torch.bfloat16:
            assert _falls_back_to_bf16_here(fmt), (fmt, layout)
            bound = PREPARATION_ERROR["bf16"]
        err = ((matrix.double() - source).norm() / source.norm()).item()
        assert err <= bound, (fmt, layout, err)
        worst[fmt] = max(worst.get(fmt, 0.0), err)
        if layout in W8A8_COPY_AT:
            smooth = weight[W8A8_COPY_AT[layout] + 3].double()
            copy = w8a8_matrix(layout, weight) * smooth
            err = ((copy - source).norm() / source.norm()).item()
            assert err <= W8A8_COPY_ERROR, (fmt, layout, "int8 copy", err)
    assert worst.get("fp32", 0.0) == 0.0 and worst.get("q4_blocks", 0.0) == 0.0


@pytest.mark.parametrize("source", ["fp8_block128x128", "sparse24", "fp8_dynamic", "w4a16_g128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_checkpoint_layouts_byte_model_counts_what_they_hold_on_the_cpu(source, dtype):
    """The roofline's bytes: fp8 block weights were counted at 1 byte each (the CPU holds a float32
    matrix: 4x) and sparse24 at 1 (its kept half in x's dtype and 4 bits of positions per group)."""
    from kiln.ops.gemm.prepared_linear.spec import _weight_bytes

    shape = {"M": 1, "N": 576, "K": 1536, "format": "kernel", "source": source}
    weight = PREPARED_LINEAR.make_inputs(shape, dtype, CPU, torch.Generator().manual_seed(0))["weight"]
    held = sum(t.numel() * t.element_size() for t in weight)
    assert _weight_bytes(shape, dtype) == pytest.approx(held, rel=0.02)
