"""flash_attention_backward: dq, dk, dv of flash_attention_with_lse from the saved LSE (spec in
spec.py, one file per backend beside it). Training reaches it through kiln.ops.autograd.flash_attention."""

from kiln.ops.attention.flash_attention_backward import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.attention.flash_attention_backward.spec import (
    FLASH_ATTENTION_BACKWARD,
    flash_attention_backward,
)

__all__ = ["FLASH_ATTENTION_BACKWARD", "flash_attention_backward"]
