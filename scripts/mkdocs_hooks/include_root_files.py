"""MkDocs hook: serve the repository's README.md and CONTRIBUTING.md as docs/index.md and
docs/contributing.md, so each text lives in one place and the site cannot drift from it."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]  # scripts/mkdocs_hooks/ -> the repository
PAGES = {"index.md": "README.md", "contributing.md": "CONTRIBUTING.md"}


def on_files(files, config):
    for page, source in PAGES.items():
        files.append(
            File.generated(config, page, content=_relink((ROOT / source).read_text(encoding="utf-8")))
        )
    return files


def _relink(text: str) -> str:
    # Links written for the repository view (docs/x.md) point at site pages (x.md).
    return text.replace("](docs/", "](").replace("](CONTRIBUTING.md", "](contributing.md")
