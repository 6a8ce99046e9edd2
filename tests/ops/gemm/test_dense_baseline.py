"""The "torch_bf16_matmul" baseline every quantized GEMM is benchmarked against computes the same layer
(a baseline that computed something else would make the reported speed-up meaningless)."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops.registry import _REGISTRY
from kiln.verify import assert_close

QUANTIZED = ["fp8_linear", "int8_linear", "int4_linear", "gguf_linear", "fp8_block_linear"]


@pytest.mark.parametrize("name", QUANTIZED)
def test_bf16_baseline_computes_the_reference(name):
    assert kiln.ops  # every op registered
    spec = _REGISTRY[name]
    for module in spec.requires:  # packages its reference needs
        pytest.importorskip(module)
    shape = spec.fuzz_shapes(random.Random(0))[1]
    generator = torch.Generator().manual_seed(random.randrange(2**31))
    inputs = spec.make_inputs(shape, torch.float32, torch.device("cpu"), generator)
    expected = spec.reference(**{k: v.double() if torch.is_tensor(v) and v.is_floating_point() and
                                 v.dtype in (torch.float32, torch.float16, torch.bfloat16) else v
                                 for k, v in inputs.items()})  # fmt: skip
    out = spec.baselines["torch_bf16_matmul"](**inputs)
    assert out.dtype == torch.bfloat16
    # x and the dequantized weight are each rounded to bf16 once, the bf16 output once more
    assert_close(out.double(), expected, 3e-2)
