"""The CPU Linear layer's dense formats: fp32 and bf16 through a oneDNN-packed weight, fp16 through the
fp16 GEMV for one row and a packed float32 copy of the same fp16-rounded weights for several rows, and
the plain F.linear fallbacks when oneDNN is missing (the layouts: kiln.ops.gemm.weight_formats; the op
they run through: tests/ops/gemm/test_prepared_linear.py)."""

import pytest
import torch

from kiln.models.layers.linear import Linear
from kiln.ops.gemm import weight_formats
from kiln.verify import assert_close

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not weight_formats.onednn_available(), reason="this torch build has no oneDNN"
)


def _layer(fmt, bias=True, out_features=96, in_features=80):
    weight = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    return Linear(weight, b, device=CPU, dtype=torch.float32, cpu_format=fmt), weight, b


def _ref(x, weight, bias):
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_cpu_linear_runs_packed_and_matches_float64(rows, bias):
    layer, weight, b = _layer("fp32", bias)
    assert layer.prepared.layout == "onednn" and layer.weight is None  # one copy of the weights
    x = torch.randn(rows, 80)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    assert_close(y, _ref(x, weight, b), 1e-6, f"fp32 packed, {rows} rows")


@needs_onednn
def test_fp16_cpu_linear_one_row_and_many_rows_agree_with_the_float64_product():
    layer, _, _ = _layer("fp16")
    assert layer.prepared.layout == "fp16_onednn"
    assert layer.weight.dtype == torch.float16 and layer.prepared.tensors[1].dtype == torch.float32
    x = torch.randn(7, 80)
    ref = _ref(x, layer.weight, layer.bias)  # the fp16-rounded weights are the model's weights
    many = layer(x)
    assert many.dtype == torch.float32
    # several rows: float32 activations against the same fp16-valued weights: float32 rounding only
    assert_close(many, ref, 1e-6, "multi-row output")
    # one row: activations rounded to fp16 (2^-11 relative) before the GEMV
    for row in range(x.shape[0]):
        assert_close(layer(x[row : row + 1]), ref[row : row + 1], 2e-3, f"row {row}")


@needs_onednn
def test_bf16_cpu_linear_is_packed_and_within_bf16_rounding():
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 path on this CPU (needs avx512bw/vl/dq or avx_ne_convert)")
    layer, weight, b = _layer("bf16")
    assert layer.prepared.layout == "onednn" and layer.prepared.tensors[0].dtype == torch.bfloat16
    x = torch.randn(5, 80)
    y = layer(x)
    assert y.dtype == torch.float32
    assert_close(y, _ref(x, weight, b), 1.6e-2, "bf16 packed")


def test_without_onednn_the_layers_fall_back_to_f_linear(monkeypatch):
    monkeypatch.setattr(weight_formats, "onednn_pack", lambda weight: None)
    for fmt in ("fp32", "fp16"):
        layer, weight, b = _layer(fmt)
        assert layer.prepared.layout == {"fp32": "dense", "fp16": "fp16_rows"}[fmt]
        x = torch.randn(6, 80)
        tol = 1e-6 if fmt == "fp32" else 2e-3
        assert_close(layer(x), _ref(x, weight, b), tol, f"{fmt} fallback, 6 rows")
        assert_close(layer(x[:1]), _ref(x[:1], weight, b), tol, f"{fmt} fallback, 1 row")
    layer, _, _ = _layer("fp16")
    assert torch.equal(layer.prepared.tensors[1], layer.weight.float())


@needs_onednn
def test_fp16_cpu_linear_with_zero_rows_and_odd_shapes():
    layer, weight, b = _layer("fp16", out_features=37, in_features=53)
    x = torch.randn(9, 53)
    assert_close(layer(x), _ref(x, layer.weight, layer.bias), 1e-6, "odd shape")
    assert layer(torch.randn(0, 53)).shape == (0, 37)


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_clearing_the_bias_takes_effect_on_every_path(fmt):
    # bias set to None after construction takes effect: no path may keep a private copy.
    layer, weight, _ = _layer(fmt)
    layer.bias = None
    tol = {"fp32": 1e-6, "fp16": 2e-3, "bf16": 1.6e-2}[fmt]
    for rows in (1, 5):
        x = torch.randn(rows, 80)
        ref = _ref(x, layer.weight if layer.weight is not None else weight, None)
        assert_close(layer(x), ref, tol, f"{fmt}, {rows} rows, bias cleared")


def test_a_weight_onednn_cannot_pack_here_falls_back_instead_of_failing(monkeypatch):
    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(weight_formats, "onednn_available", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    layer, weight, b = _layer("bf16")
    assert layer.prepared.layout == "dense" and layer.weight.dtype == torch.bfloat16
    x = torch.randn(4, 80)
    assert_close(layer(x), _ref(x, weight, b), 1.6e-2, "bf16 without oneDNN packing")
