"""Random GGUF K-quant weights and gguf's own decode of them, for the K-quant kernels' tests
(test_kquants_a8.py, test_kquants_exact.py)."""

import pytest
import torch

from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight

gguf = pytest.importorskip("gguf")


def random_part(qtype: str, n: int, k: int, g) -> GGUFWeight:
    """Fresh values, each row at its own scale, in K-quant blocks (Kiln's packer: gguf has none)."""
    values = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.2
    return GGUFWeight(qtype, quantize_blocks(values, qtype), (n, k))


def gguf_matrix(weight: GGUFWeight) -> torch.Tensor:
    """gguf's decode of the weight, float32 [N, K] (its own float32 arithmetic)."""
    kind = gguf.GGMLQuantizationType[weight.qtype]
    return torch.from_numpy(gguf.quants.dequantize(weight.data.numpy(), kind)).view(weight.shape)
