"""Every registered Pallas kernel lowers for its real target on this machine, which has neither:
`pallas_tpu` kernels through Mosaic (platform "tpu"), `pallas_gpu` kernels to Triton IR (platform
"cuda").

The other Pallas tests run the kernels in Pallas's interpreters, which accept things the lowerings
reject (Mosaic's (8, 128) tiling and supported ops; Triton's power-of-two blocks, gathers, some dtypes).
Here each op's first two fuzz shapes are traced with `compile_for_tpu()` / `compile_for_gpu()` (no
interpreter) and exported for the target, the same lowering the device would compile; only the final
Mosaic / PTX compile needs the hardware. The paged attention ops' fuzz shapes with exact positions
(an fp8 cache with exact caches, further down their lists) are lowered too, in fp8. Per-op test files
add lowering checks for the shapes and options these shapes miss."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")

from kiln.ops import all_ops  # noqa: E402
from kiln.ops.jax_bridge import to_jax  # noqa: E402
from kiln.ops.pallas_common import compile_for_gpu, compile_for_tpu  # noqa: E402

CPU = torch.device("cpu")
TARGETS = {"pallas_tpu": compile_for_tpu, "pallas_gpu": compile_for_gpu}


def _with(backend: str) -> list[str]:
    return sorted(n for n, spec in all_ops().items() if backend in spec.jax_implementations)


def _kernel_dtype(spec) -> torch.dtype:
    """bf16 where the op takes it (what the accelerators run), else its first dtype."""
    return torch.bfloat16 if torch.bfloat16 in spec.dtypes else spec.dtypes[0]


# op -> its fuzz shapes that only an fp8 cache reads (exact positions), lowered in float8_e4m3fn.
EXACT_POSITION_OPS = ("paged_decode_attention", "paged_prefill_attention")


def _exact_shapes(spec) -> list[dict]:
    return [shape for shape in spec.fuzz_shapes(random.Random(0)) if shape.get("exact_window") is not None]


def _lower_every_shape(name: str, backend: str, lower, exact_positions: bool = False) -> None:
    spec = all_ops()[name]
    kernel = spec.jax_implementations[backend]
    dtype = torch.float8_e4m3fn if exact_positions else _kernel_dtype(spec)
    shapes = _exact_shapes(spec) if exact_positions else spec.fuzz_shapes(random.Random(0))[:2]
    for shape in shapes:
        inputs = spec.make_inputs(shape, dtype, CPU, torch.Generator().manual_seed(0))
        bound = spec.bind((), inputs)
        array_at = [i for i, a in enumerate(bound) if isinstance(a, torch.Tensor)]
        arrays = [to_jax(bound[i]) for i in array_at]

        def call(*jax_arrays, bound=bound, array_at=array_at):
            args = list(bound)
            for i, array in zip(array_at, jax_arrays, strict=True):
                args[i] = array
            return kernel(*args)

        with TARGETS[backend]():
            lower(call, *arrays)


@pytest.mark.parametrize("name", _with("pallas_tpu"))
def test_pallas_tpu_kernel_lowers_through_mosaic(name, lower_for_tpu):
    _lower_every_shape(name, "pallas_tpu", lower_for_tpu)


@pytest.mark.parametrize("name", _with("pallas_gpu"))
def test_pallas_gpu_kernel_lowers_to_triton(name, lower_for_gpu):
    _lower_every_shape(name, "pallas_gpu", lower_for_gpu)


@pytest.mark.parametrize("backend", sorted(TARGETS))
@pytest.mark.parametrize("name", EXACT_POSITION_OPS)
def test_paged_attention_kernels_lower_with_exact_positions_of_an_fp8_cache(name, backend, request):
    spec = all_ops()[name]
    inputs = spec.make_inputs(
        _exact_shapes(spec)[0], torch.float8_e4m3fn, CPU, torch.Generator().manual_seed(0)
    )
    assert inputs["exact_block_tables"] is not None  # the shapes really carry exact caches
    lower = request.getfixturevalue("lower_for_tpu" if backend == "pallas_tpu" else "lower_for_gpu")
    _lower_every_shape(name, backend, lower, exact_positions=True)


def test_every_op_with_a_jax_backend_is_lowered_for_both_targets():
    # Guards the parametrization itself: an empty list would make the tests above vacuous, and an op
    # whose JAX side lacks one of the two Pallas kernels is listed in test_jax_backend_coverage.
    with_jax = {n for n, spec in all_ops().items() if spec.jax_implementations}
    assert len(with_jax) > 25
    assert set(_with("pallas_tpu")) == set(_with("pallas_gpu")) == with_jax
