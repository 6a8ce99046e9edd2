"""kiln.jax: Kiln's kernels for JAX users. Every function is jit-compatible and takes
`implementation=None | "pallas_tpu" | "pallas_gpu" | "xla"`: None picks pallas_tpu on a TPU,
pallas_gpu on a GPU and xla on the CPU; naming a Pallas backend off its accelerator runs it in
Pallas's interpreter. Bad arguments raise the same ValueErrors as the torch API (`kiln.ops`).

The same kernels back the torch OpSpecs as implementations "pallas_tpu", "pallas_gpu" and "xla"
(registered by `kiln.jax.backends`), so `kiln verify` and `kiln bench` check and time them.

    function                  torch op(s)                       kernels (in src/kiln/ops/)
    rms_norm                  rms_norm                          tpu, gpu, xla   norm/pallas.py
    softmax                   softmax                           tpu, gpu, xla   softmax/pallas.py
    silu_and_mul, gelu_tanh_and_mul                             tpu, gpu, xla   activation/pallas.py
    rope                      rotary_embedding                  tpu, xla        rope/pallas.py
    matmul                    linear (+ linear_silu_mul)        tpu, gpu, xla   gemm/pallas.py
    w8a16_matmul              w8a16_linear                      tpu, gpu, xla   gemm/pallas.py
    flash_attention           flash_attention (varlen adapter)  tpu, gpu, xla   attention/pallas.py, xla.py
    paged_decode_attention    paged_decode_attention            tpu, xla        attention/pallas_paged.py
An op without a kernel for this device (None on a GPU for rope / paged decode) runs its xla version.
`kiln.jax.llama_layer` composes them into a Llama decoder layer (prefill and paged decode).
"""

import os

# torch shares the GPU with JAX here: do not let XLA grab most of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from kiln.jax.attention import flash_attention, paged_decode_attention
from kiln.jax.dispatch import IMPLEMENTATIONS, default_implementation, tpu_interpreter
from kiln.jax.elementwise import gelu_tanh_and_mul, rope, silu_and_mul, softmax
from kiln.jax.gemm import matmul, w8a16_matmul
from kiln.jax.norm import rms_norm
from kiln.ops.rope.pallas import rope_cos_sin_cache

__all__ = [
    "IMPLEMENTATIONS",
    "default_implementation",
    "flash_attention",
    "gelu_tanh_and_mul",
    "matmul",
    "paged_decode_attention",
    "rms_norm",
    "rope",
    "rope_cos_sin_cache",
    "silu_and_mul",
    "softmax",
    "tpu_interpreter",
    "w8a16_matmul",
]
