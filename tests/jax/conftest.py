"""Shared helpers for the JAX backend tests (each test module skips itself visibly without jax)."""

import os

import pytest

# A GPU jaxlib takes 75% of the GPU's memory at its first use; the torch tests in the same process
# (and the other xdist workers on the GPU machine) need theirs. Read when jax starts its backend.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@pytest.fixture
def lower_for_tpu():
    """Lower a jitted function for the TPU platform (Pallas -> Mosaic MLIR) without a TPU: catches
    block shapes and ops Mosaic rejects at lowering time. Returns the StableHLO text."""
    jax = pytest.importorskip("jax")

    def lower(fn, *args):
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
        text = exported.mlir_module()
        assert "tpu_custom_call" in text, "expected a Mosaic custom call in the lowered module"
        return text

    return lower
