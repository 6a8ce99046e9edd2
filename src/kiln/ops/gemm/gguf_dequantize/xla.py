"""gguf_dequantize in jax.numpy (XLA): every block format of the spec decoded by ../jax_codecs.py in
float32 (the same operations as kiln.quant.gguf_blocks), rounded to `dtype`. Other GGML type names
decode on the host through `gguf.quants` (NumPy; not jittable), as the torch op does."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kiln.ops.gemm.gguf_blocks import QTYPES
from kiln.ops.gemm.gguf_dequantize.spec import GGUF_DEQUANTIZE
from kiln.ops.gemm.jax_codecs import dequantize_gguf, jnp_dtype
from kiln.quant.gguf_blocks import dequantize_any


def gguf_dequantize_xla(qweight, qtype, dtype=jnp.float32):
    out_dtype = jnp_dtype(dtype)
    if qtype not in QTYPES:
        return jnp.asarray(dequantize_any(np.asarray(qweight), qtype).numpy()).astype(out_dtype)
    return dequantize_gguf(qweight, qtype).astype(out_dtype)


GGUF_DEQUANTIZE.register_jax("xla", gguf_dequantize_xla)
