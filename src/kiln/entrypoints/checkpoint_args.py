"""What `kiln quantize` and `kiln sparsify` share: their common arguments (SOURCE, --out, --ignore,
--calibration, --max-calibration-tokens) and what those mean: which tensors are the decoder layers'
projections, the checks on SOURCE / --out, the calibration text and its tokens, and the files
copied from SOURCE unchanged."""

from __future__ import annotations

import argparse
import os
import re
import shutil

# the decoder layers' dense projections, as module names (their weight: name + ".weight")
PROJECTION_MODULE = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$")


def add_checkpoint_parser(
    subparsers, name: str, *, help: str, doc: str, ignore_help: str, calibration_help: str
) -> argparse.ArgumentParser:
    """The `kiln <name>` subparser (description: the first paragraph of the module docstring `doc`)
    with SOURCE, --out, --ignore REGEX (repeatable; `ignore_help` says what an ignored weight stays),
    --calibration FILE and --max-calibration-tokens; the caller adds its own options."""
    parser = subparsers.add_parser(name, help=help, description=doc.split("\n\n")[0])
    parser.add_argument("source", help="HF checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--out", required=True, help="output directory (created; must not be SOURCE)")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="REGEX",
        help=f"leave weights whose name matches {ignore_help} (repeatable), "
        "e.g. 'layers\\.0\\.' or 'down_proj'",
    )
    parser.add_argument("--calibration", default=None, help=calibration_help)
    parser.add_argument("--max-calibration-tokens", type=int, default=512)
    return parser


def is_projection_weight(name: str, ignore: list[re.Pattern]) -> bool:
    """Whether checkpoint tensor `name` is a decoder-layer projection's weight that no `ignore`
    pattern matches (patterns are searched in the full name, ".weight" included)."""
    return (
        name.endswith(".weight")
        and bool(PROJECTION_MODULE.match(name[: -len(".weight")]))
        and not any(p.search(name) for p in ignore)
    )


def source_safetensors(command: str, source: str, out: str) -> list[str]:
    """The sorted *.safetensors file names of the HF checkpoint directory `source`; ValueError
    (prefixed with `command`) when it has no config.json or no safetensors, or when `out` is it."""
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise ValueError(f"{command}: {source} is not an HF checkpoint directory (no config.json)")
    files = sorted(f for f in os.listdir(source) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{command}: {source} has no *.safetensors files")
    if os.path.abspath(out) == os.path.abspath(source):
        raise ValueError(f"{command}: --out must differ from the source directory")
    return files


def copy_other_files(source: str, out: str, written: set[str]) -> None:
    """Copy every plain file of `source` into `out` except the safetensors, the index and the
    names in `written` (what the command writes itself)."""
    skip = written | {"model.safetensors.index.json"}
    for entry in os.listdir(source):
        path = os.path.join(source, entry)
        if entry.endswith(".safetensors") or entry in skip or not os.path.isfile(path):
            continue
        shutil.copy2(path, os.path.join(out, entry))


def read_calibration(path: str | None) -> str | None:
    """The text of the --calibration file, or None when none was given."""
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def calibration_model(command: str, source: str, text: str | None, max_tokens: int):
    """(Kiln's float32 CPU model of `source` as a LoadedModel, the first `max_tokens` token ids of
    `text`; None: the text `kiln verify --quant-model` calibrates on). ValueError when that gives
    fewer than 2 tokens."""
    import torch

    from kiln.loaders import load_model
    from kiln.models.calibration import read_text

    if text is None:
        text = read_text("calibration.txt")
    loaded = load_model(source, device="cpu", dtype=torch.float32, cpu_format="fp32", lm_head_format="fp32")
    ids = loaded.tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"{command}: the calibration text gives fewer than 2 tokens")
    return loaded, ids
