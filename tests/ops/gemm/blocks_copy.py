"""What an exact blocks layout's many-row calls (past the row and tile kernels) multiply: the float32
copy through oneDNN where the layout keeps one, else the panel kernel on the blocks
(kiln.ops.gemm.cpu_blocks_panel; the copy is then an empty tensor)."""

import torch

from kiln.ops.gemm.cpu_blocks_panel import block_matrix, blocks_panel_gemm
from kiln.ops.gemm.weight_formats import onednn_linear


def many_rows_matrix(tensors, blocks: int) -> torch.Tensor:
    """The float32 [N, K] matrix of the many-row path: the copy (tensors[blocks]) read back, or the
    blocks (tensors[:blocks]) as the panel kernel decodes them."""
    copy = tensors[blocks]
    if copy.numel():
        return onednn_linear(torch.eye(copy.shape[1]), copy, None).T
    return block_matrix(tensors[0], tensors[1], tensors[2] if blocks == 3 else None)


def many_rows(x: torch.Tensor, tensors, blocks: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y float32 [M, N] as the many-row path computes it for x [M, K]."""
    copy = tensors[blocks]
    if copy.numel():
        return onednn_linear(x, copy, bias)
    y = blocks_panel_gemm(x, *tensors[:blocks])
    return y if bias is None else y.add_(bias.float())
