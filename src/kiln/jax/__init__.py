"""kiln.jax: Kiln's kernels for JAX users. Every function is jit-compatible and takes
`implementation=None | "pallas_tpu" | "pallas_gpu" | "xla"`: None picks pallas_tpu on a TPU,
pallas_gpu on a GPU and xla on the CPU; naming a Pallas backend off its accelerator runs it in
Pallas's interpreter. Bad arguments raise the same ValueErrors as the torch API (`kiln.ops`).

The same kernels back the torch OpSpecs as implementations "pallas_tpu", "pallas_gpu" and "xla"
(registered by `kiln.jax.backends`), so `kiln verify` and `kiln bench` check and time them.
"""

from kiln.jax.norm import rms_norm
from kiln.jax.platform import IMPLEMENTATIONS, default_implementation, tpu_interpreter

__all__ = ["IMPLEMENTATIONS", "default_implementation", "rms_norm", "tpu_interpreter"]
