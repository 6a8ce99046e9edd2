"""Bench/tune/profile tests never touch ~/.cache: ceilings are measured once per session into a temp
file, and the tuning cache is a fresh temp file per test."""

import pytest

import kiln.tune.cache as tune_cache


@pytest.fixture(scope="session")
def ceilings_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kiln-ceilings") / "ceilings.json"


@pytest.fixture(autouse=True)
def isolated_caches(ceilings_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CEILINGS_CACHE", str(ceilings_cache))
    monkeypatch.setenv("KILN_TUNE_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setattr(tune_cache, "_user_entries", None)
    yield
    tune_cache._shipped.cache_clear()  # a test may have pointed SHIPPED_DIR elsewhere
