"""The op -> files table of docs/architecture.md, generated from the registry and the tree.

    python scripts/op_table.py            # print the table
    python scripts/op_table.py --write    # rewrite it in docs/architecture.md (between the markers)

tests/test_docs.py fails when the committed table differs from what this prints.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- op-table:begin -->", "<!-- op-table:end -->"
BACKEND_FILES = ("triton.py", "triton_tma.py", "cpu.py", "pallas_tpu.py", "pallas_gpu.py", "xla.py")


def table() -> str:
    import kiln.ops

    rows = [
        "| op | folder (`src/kiln/ops/`) | backend files beside `spec.py` | implementations "
        "| tests (`tests/ops/`) |",
        "|---|---|---|---|---|",
    ]
    for name, spec in kiln.ops.all_ops().items():
        folder = Path(spec.source_file).parent  # the folder of the spec.py that defined the op
        relative = folder.relative_to(ROOT / "src" / "kiln" / "ops").as_posix()
        files = [f.removesuffix(".py") for f in BACKEND_FILES if (folder / f).exists()]
        family = relative.split("/")[0]
        stems = {f"test_{stem}{suffix}" for stem in (name, folder.name) for suffix in ("", "_pallas")}
        tests = sorted(p.name for p in (ROOT / "tests" / "ops" / family).glob("test_*.py") if p.stem in stems)
        rows.append(
            f"| `{name}` | `{relative}/` | {', '.join(files)} | {', '.join(spec.implementations)} | "
            f"{', '.join(f'`{family}/{t}`' for t in tests)} |"
        )
    return "\n".join(rows)


def replace(text: str, new_table: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{new_table}\n{END}{tail}"


def main() -> int:
    new_table = table()
    if "--write" in sys.argv[1:]:
        DOC.write_text(replace(DOC.read_text(encoding="utf-8"), new_table), encoding="utf-8")
    else:
        print(new_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
