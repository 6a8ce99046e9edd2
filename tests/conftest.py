"""Test set-up: without CUDA, Triton kernels run through Triton's interpreter on CPU tensors.
TRITON_INTERPRET must be set before any kernel module is imported, hence here at the top."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests run: the GPU when there is one, else the CPU (Triton interpreted)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="GPU-only test: no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ceilings_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kiln-ceilings") / "ceilings.json"


@pytest.fixture(autouse=True)
def isolated_caches(ceilings_cache, tmp_path, monkeypatch):
    """No test touches ~/.cache: device ceilings are measured once per session into a temp file, and
    the tuning cache is a fresh temp file per test."""
    import kiln.ops.tuned_configs as tune_cache

    monkeypatch.setenv("KILN_CEILINGS_CACHE", str(ceilings_cache))
    monkeypatch.setenv("KILN_TUNE_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setattr(tune_cache, "_user_entries", None)
    yield
    tune_cache._shipped.cache_clear()  # a test may have pointed SHIPPED_DIR elsewhere
