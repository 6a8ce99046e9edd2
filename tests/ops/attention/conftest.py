"""Fixtures of the attention tests."""

import pytest

from kiln.ops.attention.paged_decode_attention import cpu_native


@pytest.fixture
def native():
    """The native CPU decode kernel, loaded (skipped where it cannot be built)."""
    if not cpu_native.load():
        pytest.skip("the native CPU decode kernel could not be built here (no C++ compiler or ninja)")


@pytest.fixture(params=[True, False], ids=["native", "pytorch"])
def native_decode(request, monkeypatch):
    """The CPU decode attention with its native kernel (the `native` fixture) and without it (its
    PyTorch forms). Yields whether the native kernel serves float caches."""
    if request.param:
        request.getfixturevalue("native")
    else:
        monkeypatch.setitem(cpu_native._state, "loaded", False)
    return request.param
