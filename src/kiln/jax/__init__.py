"""kiln.jax: Kiln's kernels for JAX users, generated from the same op specs as `kiln.ops`.

Every op with JAX implementations (`pallas_tpu.py`, `pallas_gpu.py`, `xla.py` beside its spec) is
here under its op name, e.g. `kiln.jax.rms_norm(x, weight, eps, residual, implementation=None)`:
validated by the spec's own validator (the same ValueErrors as the torch API), jit-compatible, and
`implementation=None` picks pallas_tpu on a TPU, pallas_gpu on a GPU and xla on the CPU (an op
without this device's kernel runs xla); naming a Pallas backend off its accelerator runs it in
Pallas's interpreter. Arguments the torch op writes in place (rms_norm's residual, rotary's q and k)
come back as new arrays after the outputs, since JAX arrays are immutable.

`kiln.jax.rms_norm`, `silu_and_mul` and `gelu_tanh_and_mul` are differentiable (`jax.grad`): a
`jax.custom_vjp` whose backward, behind the pallas_tpu forward, is a Pallas kernel (kiln.jax.autodiff,
kiln.jax.backward_pallas), and behind the others XLA's autodiff of the XLA forward. So is the
padded-batch `kiln.jax.flash_attention` (kiln.jax.attention_autodiff: behind pallas_tpu the Pallas TPU
backward kernels recomputing from the saved LSE, kiln.ops.attention.flash_attention_backward.pallas_tpu).

`kiln.jax.IMPLEMENTED` maps each op to its JAX implementations.

`kiln.jax.models.Llama` is a Llama-family model over these ops (weights through Kiln's loaders, a
paged KV cache, jitted prefill/decode steps, tensor parallel over a device mesh), and
`kiln.jax.generate(model, prompts, max_tokens, temperature=0)` generates with it.
"""

import os

# torch shares the GPU with JAX here: do not let XLA grab most of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from kiln.ops import all_ops  # noqa: E402
from kiln.ops.jax_bridge import jax_function  # noqa: E402
from kiln.ops.pallas_common import IMPLEMENTATIONS, default_implementation, tpu_interpreter  # noqa: E402

IMPLEMENTED: dict[str, tuple[str, ...]] = {}
for _name, _spec in all_ops().items():
    if _spec.jax_implementations:
        globals()[_name] = jax_function(_spec)
        IMPLEMENTED[_name] = tuple(_spec.jax_implementations)

# rms_norm and the gated activations are differentiable: jax.custom_vjp with Pallas backward kernels.
# kiln.jax.flash_attention keeps the padded-batch layout (the op itself is varlen); differentiable too.
from kiln.jax.attention_layouts import flash_attention  # noqa: E402,F401
from kiln.jax.autodiff import gelu_tanh_and_mul, rms_norm, silu_and_mul  # noqa: E402,F401

# The GEMMs' older JAX names: matmul = linear, w8a16_matmul = w8a16_linear.
from kiln.jax.gemm_layouts import matmul, w8a16_matmul  # noqa: E402,F401

# A Llama over these ops (kiln.jax.models): generate(model, prompts, max_tokens, temperature=0).
from kiln.jax.models import generate  # noqa: E402

# The old rotary names: rope = rotary_embedding, and the cos/sin table as a jax array.
from kiln.jax.rope_layouts import rope, rope_cos_sin_cache  # noqa: E402,F401

__all__ = ["IMPLEMENTATIONS", "IMPLEMENTED", "default_implementation", "tpu_interpreter", *IMPLEMENTED]
__all__ += ["flash_attention", "matmul", "rope", "rope_cos_sin_cache", "w8a16_matmul"]
__all__ += ["generate"]
