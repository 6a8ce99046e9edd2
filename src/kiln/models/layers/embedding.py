"""Token embedding (and the LM head that may share its weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.models.weights import GGUFWeight, Weight


class VocabEmbedding(torch.nn.Module):
    """input_ids int64 [T] -> [T, hidden] in `dtype` (GGUF-quantized tables are dequantized once)."""

    def __init__(self, weight: Weight, *, device: torch.device, dtype: torch.dtype):
        super().__init__()
        if isinstance(weight, GGUFWeight):
            weight = weight.dequantize(torch.float32)
        self.weight = weight.to(device=device, dtype=dtype).contiguous()
        self.num_embeddings, self.embedding_dim = self.weight.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
