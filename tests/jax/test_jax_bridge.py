"""kiln.ops.jax_bridge, what the torch face of the JAX implementations (verify, bench) passes through:
int64 tensors without JAX's x64 mode, and which device the arrays are computed on."""

import pytest
import torch

jax = pytest.importorskip("jax")

from kiln.ops import jax_bridge  # noqa: E402


def test_an_int64_tensor_becomes_int32_only_when_its_values_fit():
    """JAX's own DLPack import kept the low 32 bits of 2**33 + 5: 5, silently."""
    if jax.config.jax_enable_x64:
        pytest.skip("JAX runs with x64 here: int64 stays int64")
    fits = jax_bridge.to_jax(torch.tensor([1, -(2**31), 2**31 - 1], dtype=torch.int64))
    assert fits.dtype == jax.numpy.int32 and fits.tolist() == [1, -(2**31), 2**31 - 1]
    with pytest.raises(ValueError, match=r"outside int32 \[1, 8589934597\]"):
        jax_bridge.to_jax(torch.tensor([1, 2**33 + 5], dtype=torch.int64))
    assert jax_bridge.to_jax(torch.zeros(0, dtype=torch.int64)).shape == (0,)


def test_cuda_tensors_stay_on_their_own_gpu(monkeypatch):
    """pallas_gpu moved every array to JAX's first GPU: a cuda:1 tensor's op ran on GPU 0."""
    from kiln.ops import pallas_common

    monkeypatch.setattr(pallas_common, "on_gpu", lambda: True)
    monkeypatch.setattr(pallas_common, "on_tpu", lambda: False)
    assert jax_bridge._compute_device("pallas_gpu", torch.device("cuda", 1)) is None
    assert jax_bridge._compute_device("xla", torch.device("cuda", 0)) is None
    assert jax_bridge._compute_device("pallas_gpu", torch.device("cpu")) is jax.devices()[0]
