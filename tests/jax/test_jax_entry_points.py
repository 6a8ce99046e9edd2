"""Every `kiln.jax.<op>` entry point runs eagerly and under jax.jit on its spec's first fuzz case (xla
implementation), with JAX's default 32-bit integers: fused_moe and rejection_sample read `.numel()` of
a JAX array in their validators, and rejection_sample refused int32 token ids, so neither could be
called at all."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")

import kiln.jax  # noqa: E402
from kiln.ops import all_ops  # noqa: E402
from kiln.ops.jax_bridge import to_jax  # noqa: E402

# entries whose JAX signature is not the op's: flash_attention takes padded [B, S, H, D] batches
OWN_SIGNATURE = {"flash_attention"}
OPS = sorted(
    name for name, spec in all_ops().items() if spec.jax_implementations and name not in OWN_SIGNATURE
)


@pytest.mark.parametrize("name", OPS)
def test_entry_point_runs_eagerly_and_under_jit(name):
    spec = all_ops()[name]
    entry = getattr(kiln.jax, name)
    dtype = torch.bfloat16 if torch.bfloat16 in spec.dtypes else spec.dtypes[0]
    shape = spec.fuzz_shapes(random.Random(0))[0]
    inputs = spec.make_inputs(shape, dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
    bound = list(spec.bind((), inputs))
    where = [i for i, arg in enumerate(bound) if isinstance(arg, torch.Tensor)]
    arrays = [to_jax(bound[i]) for i in where]

    def call(*arrays):
        args = list(bound)
        for i, array in zip(where, arrays, strict=True):
            args[i] = array
        return entry(*args, implementation="xla")

    eager = jax.tree_util.tree_leaves(call(*arrays))
    jitted = jax.tree_util.tree_leaves(jax.jit(call)(*arrays))
    assert len(eager) == len(jitted) > 0
    for a, b in zip(eager, jitted, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
