"""gelu_tanh_and_mul's JAX backends (TPU interpreter, Pallas interpreter, XLA) against float64."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.activation.gelu_tanh_and_mul.pallas_tpu import gelu_tanh_and_mul_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

BACKENDS = ["pallas_tpu", "pallas_gpu", "xla"]
# The JAX backends take CPU tensors on any machine (through DLPack; moved to a TPU/GPU if there is one).
CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gelu_tanh_and_mul_jax_backends_match_the_specs_float64_reference(backend, dtype):
    shape = {"rows": 4, "d": 130}
    case = run_case(get_op("gelu_tanh_and_mul"), backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", BACKENDS)
def test_gelu_tanh_keeps_relative_precision_deep_in_the_negative_tail(backend):
    # gelu_tanh(-5) ~ -1.4e-6: written as 0.5*g*(1 + tanh(z)), float32 cancels 1 + tanh(z) to garbage
    # (a single-element fuzz case caught a 2.5e-2 relative error); the sigmoid form keeps it exact.
    gate = torch.tensor([-5.0, -4.0, -6.5, 0.3], dtype=torch.float64)
    up = torch.tensor([1.3, -0.7, 2.0, 1.1], dtype=torch.float64)
    x = torch.stack([gate, up], dim=0).T.reshape(4, 2).contiguous()  # rows of [gate, up], d = 1
    g = x[:, :1]
    ref = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))) * x[:, 1:]
    out = kjax.gelu_tanh_and_mul(jnp.asarray(x.float().numpy()), implementation=backend)
    rel = (torch.from_numpy(np.array(out)).double() - ref).abs() / ref.abs()
    assert float(rel.max()) < 1e-4, rel


def test_gelu_tanh_and_mul_kiln_jax_rejects_an_odd_last_dim():
    with pytest.raises(ValueError, match="gelu_tanh_and_mul: x has last dim 3, expected an even size"):
        kjax.gelu_tanh_and_mul(jnp.ones((2, 3)))


def test_gelu_tanh_and_mul_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x = jnp.ones((13, 512), jnp.bfloat16)
    lower_for_tpu(lambda a: gelu_tanh_and_mul_pallas_tpu(a, interpret=False), x)
