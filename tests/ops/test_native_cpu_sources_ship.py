"""The native CPU library is built on the user's host from sources inside the installed package: every
source and header kiln.ops.native_cpu builds from must be in the package data pyproject.toml ships."""

import fnmatch
import os

import tomllib

from kiln.ops import native_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")


def test_every_native_source_and_header_ships_as_package_data():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    files = [*native_cpu.SOURCES, *native_cpu.HEADERS]
    assert len(files) >= 12
    missing = []
    for path in files:
        assert os.path.exists(path), path
        relative = os.path.relpath(os.path.realpath(path), os.path.realpath(SRC))
        folder, name = os.path.split(relative)
        package = folder.replace(os.sep, ".")
        # a package's glob may name a subfolder ("texts/*.txt"); sources sit beside their package's modules
        if not any(fnmatch.fnmatch(name, glob) for glob in package_data.get(package, [])):
            missing.append(relative)
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"


def test_avx512_builds_add_vnni_where_the_host_has_it(monkeypatch):
    """The K-quant kernels' VNNI path (vpdpwssd) is compiled only for hosts whose CPU has avx512_vnni
    (an AVX-512 CPU without it, e.g. Skylake-X, would fault on it), and KILN_CPU_VNNI=0 leaves it out."""
    monkeypatch.delenv("KILN_CPU_VNNI", raising=False)  # a run with it set must not decide this test
    host = {"cpu_flags": ["avx2", "avx512f", "avx512_vnni"]}
    monkeypatch.setattr(native_cpu.environment, "cpu", lambda: host)
    monkeypatch.setattr(native_cpu.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert native_cpu._isa_flags() == [*native_cpu.ISA_FLAGS["AVX512"], "-mavx512vnni"]
    monkeypatch.setenv("KILN_CPU_VNNI", "0")
    assert native_cpu._isa_flags() == native_cpu.ISA_FLAGS["AVX512"]
    monkeypatch.delenv("KILN_CPU_VNNI")
    host["cpu_flags"] = ["avx2", "avx512f"]
    assert native_cpu._isa_flags() == native_cpu.ISA_FLAGS["AVX512"]
    host["cpu_flags"] = ["avx2", "avx512_vnni"]  # an AVX2 build never takes it
    monkeypatch.setattr(native_cpu.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert native_cpu._isa_flags() == native_cpu.ISA_FLAGS["AVX2"]
