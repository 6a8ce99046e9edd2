"""The docs that are generated from the code stay in step with it."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_architecture_op_table_lists_every_registered_op_and_its_files():
    op_table = _load("op_table")
    committed = op_table.DOC.read_text(encoding="utf-8")
    expected = op_table.replace(committed, op_table.table())
    assert committed == expected, "stale op table in docs/architecture.md: python scripts/op_table.py --write"


def test_no_repository_file_points_readers_outside_the_repository():
    for path in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "shared/STYLE.md" not in path.read_text(encoding="utf-8"), path
