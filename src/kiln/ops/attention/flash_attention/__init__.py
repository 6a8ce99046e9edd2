"""flash_attention and flash_attention_with_lse (one kernel, two ops: the result arity differs):
specs (signature, reference, shapes) in spec.py, one file per backend beside it (pallas_tpu.py,
pallas_gpu.py and xla.py register themselves when jax is installed, see kiln.ops.jax_bridge)."""

from kiln.ops.attention.flash_attention import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.attention.flash_attention.spec import (
    FLASH_ATTENTION,
    FLASH_ATTENTION_WITH_LSE,
    flash_attention,
    flash_attention_with_lse,
)

__all__ = ["FLASH_ATTENTION", "FLASH_ATTENTION_WITH_LSE", "flash_attention", "flash_attention_with_lse"]
