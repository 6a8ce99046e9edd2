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
