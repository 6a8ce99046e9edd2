"""Every registered `pallas_gpu` kernel lowers to Triton IR for CUDA on this CPU-only machine.

The other Pallas-GPU tests run the kernels in the Pallas interpreter, which accepts things the Triton
lowering rejects (non-power-of-two blocks, gathers, some dtypes). Here each op's first two fuzz shapes
are traced with `compile_for_gpu()` (no interpreter) and exported for the `cuda` platform, the same
lowering a GPU would compile; only the PTX compile itself needs the GPU."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")

from kiln.ops import all_ops  # noqa: E402
from kiln.ops.jax_bridge import to_jax  # noqa: E402
from kiln.ops.pallas_common import compile_for_gpu  # noqa: E402

CPU = torch.device("cpu")
OPS_WITH_PALLAS_GPU = sorted(n for n, spec in all_ops().items() if "pallas_gpu" in spec.jax_implementations)


def _kernel_dtype(spec) -> torch.dtype:
    """bf16 where the op takes it (what a GPU runs), else its first dtype."""
    return torch.bfloat16 if torch.bfloat16 in spec.dtypes else spec.dtypes[0]


@pytest.mark.parametrize("name", OPS_WITH_PALLAS_GPU)
def test_pallas_gpu_kernel_lowers_to_triton(name, lower_for_gpu):
    spec = all_ops()[name]
    kernel = spec.jax_implementations["pallas_gpu"]
    dtype = _kernel_dtype(spec)
    for shape in spec.fuzz_shapes(random.Random(0))[:2]:
        inputs = spec.make_inputs(shape, dtype, CPU, torch.Generator().manual_seed(0))
        bound = spec.bind((), inputs)
        array_at = [i for i, a in enumerate(bound) if isinstance(a, torch.Tensor)]
        arrays = [to_jax(bound[i]) for i in array_at]

        def call(*jax_arrays, bound=bound, array_at=array_at):
            args = list(bound)
            for i, array in zip(array_at, jax_arrays, strict=True):
                args[i] = array
            return kernel(*args)

        with compile_for_gpu():
            lower_for_gpu(call, *arrays)


def test_the_list_covers_the_kernels_already_written():
    # Guards the parametrization itself: an empty list would make the test above vacuous.
    assert {"layer_norm", "rms_norm", "flash_attention", "paged_decode_attention", "linear"} <= set(
        OPS_WITH_PALLAS_GPU
    )
