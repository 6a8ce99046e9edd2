"""Fixtures for the op tests."""

import pytest


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
