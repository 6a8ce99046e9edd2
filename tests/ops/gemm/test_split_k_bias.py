"""The split-K reduce adds a bias of any strides: it read `bias_ptr + n` while the GEMM kernels were
handed `bias.contiguous()`, so a strided bias (a view, e.g. every other element of a fused bias) came
out as the wrong elements whenever the K split was above 1 (a reviewer's repro: max error 1.9-3.7 on
the GGUF planes' GEMM at split 4, 3e-6 at split 1). Every Triton GEMM that takes a bias, at split 4."""

import pytest
import torch

from kiln.ops.gemm.gguf_linear.triton import gguf_linear_triton
from kiln.ops.gemm.gguf_planar import pack_planar
from kiln.ops.gemm.gguf_planar_triton import gguf_planar_linear_triton
from kiln.ops.gemm.linear.triton import linear_pointer_triton
from kiln.quant.gguf_blocks import dequantize_blocks, quantize_blocks
from kiln.verify import assert_close

SPLIT_4 = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 8, "SPLIT_K": 4, "num_warps": 4,
           "num_stages": 2}  # fmt: skip


@pytest.mark.parametrize("kernel", ["linear", "gguf_linear", "gguf_planar"])
def test_a_strided_bias_is_added_right_under_split_k(kernel, device):
    generator = torch.Generator().manual_seed(5)
    M, N, K = 2, 19, 256
    x = torch.randn(M, K, generator=generator)
    bias = torch.randn(2 * N, generator=generator)[::2]  # strided view
    assert not bias.is_contiguous()
    blocks = quantize_blocks(torch.randn(N, K, generator=generator), "Q4_1")
    weight = dequantize_blocks(blocks, "Q4_1", torch.float32)
    x_d, bias_d = x.to(device), bias.to(device)
    if kernel == "linear":
        out = linear_pointer_triton(x_d, weight.to(device), bias_d, config=SPLIT_4)
    elif kernel == "gguf_linear":
        out = gguf_linear_triton(x_d, blocks.to(device), "Q4_1", bias_d, config=SPLIT_4)
    else:
        planes = [t.to(device) for t in pack_planar(blocks, "Q4_1")]
        out = gguf_planar_linear_triton(x_d, planes, "Q4_1", bias_d, config=SPLIT_4)
    assert_close(out.cpu(), x.double() @ weight.double().T + bias.double(), 1e-5)
