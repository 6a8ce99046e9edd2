"""The CPU Linear layer's fp16 format: one row goes through the fp16 GEMV, several rows through a float32
copy of the same fp16-rounded weights (PyTorch's CPU fp16 GEMM is slow beyond one row)."""

import torch

from kiln.models.layers.linear import Linear
from kiln.verify import assert_close


def test_fp16_cpu_linear_keeps_identical_weights_for_multi_row_inputs():
    weight, bias = torch.randn(96, 80), torch.randn(96)
    layer = Linear(weight, bias, device=torch.device("cpu"), dtype=torch.float32, cpu_format="fp16")
    assert layer.weight.dtype == torch.float16
    assert torch.equal(layer.rows_weight, layer.weight.float())


def test_fp16_cpu_linear_one_row_and_many_rows_agree_with_the_float64_product():
    weight, bias = torch.randn(96, 80), torch.randn(96)
    layer = Linear(weight, bias, device=torch.device("cpu"), dtype=torch.float32, cpu_format="fp16")
    x = torch.randn(7, 80)
    ref = x.double() @ layer.weight.double().T + layer.bias.double()
    many = layer(x)
    assert many.dtype == torch.float32
    # several rows: float32 activations against the same fp16-valued weights: float32 rounding only
    assert_close(many, ref, 1e-6, "multi-row output")
    # one row: activations rounded to fp16 (2^-11 relative) before the GEMV
    for row in range(x.shape[0]):
        assert_close(layer(x[row : row + 1]), ref[row : row + 1], 2e-3, f"row {row}")
