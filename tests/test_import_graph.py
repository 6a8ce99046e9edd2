"""No import cycle between the files of src/kiln or between its top-level packages, and no package
imports one above it (server, entrypoints -> distributed -> engine -> loaders -> models -> ops -> quant;
jax over ops; bench, verify, profile, tune on top). The graph and the checks are
scripts/check_imports.py (run it for the full report); known exceptions would be listed below, each
as the import edge that should go."""

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_imports.py"
_spec = importlib.util.spec_from_file_location("check_imports", _SCRIPT)
check_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_imports)

# Known file-level cycles, as (importer, imported) edges that close them (none left).
ALLOWED_FILE_EDGES: set[tuple[str, str]] = set()

# Known package-level cycles and upward imports, as (importer, imported) package edges.
ALLOWED_PACKAGE_EDGES: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def graph():
    return check_imports.import_graph()


@pytest.fixture(scope="module")
def packages(graph):
    return check_imports.package_graph(graph)


def test_graph_sees_top_level_and_function_level_imports(graph):
    assert "kiln.ops.registry" in graph["kiln.bench.runner"]  # top level: from kiln.ops.registry import
    assert "kiln.bench.engine" in graph["kiln.bench.cli"]  # from kiln.bench import engine (a module)
    assert "kiln.profile.engine_step" in graph["kiln.profile.cli"]  # from ... import inside run()


def test_imports_under_type_checking_do_not_count(tmp_path):
    package = tmp_path / "kiln"
    package.mkdir()
    (package / "__init__.py").write_text("")
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln import b\n"
    (package / "a.py").write_text(type_only)
    (package / "b.py").write_text("def f():\n    import kiln.a\n")
    assert check_imports.import_graph(tmp_path) == {"kiln": {}, "kiln.a": {}, "kiln.b": {"kiln.a": 2}}


def test_cycle_finder_reports_each_loop_once():
    graph = {"a": {"b": 1}, "b": {"c": 1, "a": 2}, "c": {"a": 1}, "d": {"a": 1}}
    assert check_imports.file_cycles(graph) == [["a", "b", "a"], ["a", "b", "c", "a"]]
    assert check_imports.file_cycles(graph, ignored={("b", "a"), ("c", "a")}) == []


def test_direction_flags_a_lower_package_importing_a_higher_one():
    edges = {
        ("kiln.engine", "kiln.models"): ["down"],
        ("kiln.models", "kiln.engine"): ["up"],
        ("kiln.ops", "kiln.bench"): ["up"],
        ("kiln.server", "kiln.ops"): ["down, skipping levels"],
        ("kiln.bench", "kiln.verify"): ["between tools"],
    }
    assert set(check_imports.direction_violations(edges)) == {
        ("kiln.models", "kiln.engine"),
        ("kiln.ops", "kiln.bench"),
    }


def test_no_import_cycle_between_files(graph):
    cycles = check_imports.file_cycles(graph, ignored=ALLOWED_FILE_EDGES)
    assert not cycles, "import cycles between files:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycle_between_packages(packages):
    cycles = check_imports.package_cycles(packages, ignored=ALLOWED_PACKAGE_EDGES)
    assert not cycles, "import cycles between packages:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_package_imports_one_above_it(packages):
    upward = {
        edge: why
        for edge, why in check_imports.direction_violations(packages).items()
        if edge not in ALLOWED_PACKAGE_EDGES
    }
    assert not upward, "\n".join(f"{a} -> {b}: {'; '.join(why)}" for (a, b), why in upward.items())


def test_allow_lists_hold_only_imports_that_still_exist(graph, packages):
    # a fixed exception must leave the list, so that it cannot come back unnoticed
    gone_files = {(a, b) for a, b in ALLOWED_FILE_EDGES if b not in graph.get(a, {})}
    gone_packages = {edge for edge in ALLOWED_PACKAGE_EDGES if edge not in packages}
    assert not gone_files and not gone_packages, f"remove from the allow-lists: {gone_files | gone_packages}"
