"""What the norm family's Triton launchers share: rows as a [rows, hidden] view, the widest block."""

from __future__ import annotations

import torch

from kiln.ops.checks import as_rows

# Widest row block a program holds in registers; wider rows loop over column blocks.
MAX_BLOCK_N = 8192


def rows(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> [rows, hidden] with a unit column stride (copies only if it must)."""
    t2 = as_rows(t)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
