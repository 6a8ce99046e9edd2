"""`kiln.jax.<op>` takes dtype arguments the JAX way (jnp.float32, jnp.bfloat16, "float16") as well as
torch dtypes, with the same result; a dtype the op does not take is still named by its validator."""

import pytest
import torch

jnp = pytest.importorskip("jax.numpy")

import kiln.jax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.jax_bridge import to_jax  # noqa: E402


@pytest.mark.parametrize(
    ("jax_dtype", "torch_dtype"),
    [(jnp.float32, torch.float32), (jnp.bfloat16, torch.bfloat16), ("float16", torch.float16)],
)
def test_out_dtype_given_as_a_jax_dtype_equals_the_torch_one(jax_dtype, torch_dtype):
    spec = get_op("fp8_block_linear")
    shape = {"M": 3, "N": 40, "K": 160, "block_n": 16, "block_k": 32}
    inputs = spec.make_inputs(shape, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    args = {k: to_jax(v, None) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    by_jax = kiln.jax.fp8_block_linear(**{**args, "out_dtype": jax_dtype}, implementation="xla")
    by_torch = kiln.jax.fp8_block_linear(**{**args, "out_dtype": torch_dtype}, implementation="xla")
    assert by_jax.dtype == by_torch.dtype == jnp.dtype(str(torch_dtype).removeprefix("torch."))
    assert bool(jnp.array_equal(by_jax, by_torch))


def test_an_unsupported_jax_dtype_is_still_named():
    spec = get_op("fp8_block_linear")
    shape = {"M": 3, "N": 40, "K": 160, "block_n": 16, "block_k": 32}
    inputs = spec.make_inputs(shape, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    args = {k: to_jax(v, None) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with pytest.raises(ValueError, match="out_dtype"):
        kiln.jax.fp8_block_linear(**{**args, "out_dtype": jnp.int32}, implementation="xla")
