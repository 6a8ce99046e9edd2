"""`kiln sparsify`: prune an HF safetensors checkpoint to 2:4 sparsity and write it in the layout
`load_model` recognises.

    kiln sparsify SRC_DIR --out DIR [--method magnitude|wanda] [--ignore REGEX ...] [--calibration FILE]
                  [--dense]

Pruned: the decoder layers' dense projections (`model.layers.N.{self_attn.{q,k,v,o}_proj,
mlp.{gate,up,down}_proj}.weight`, in_features a multiple of 4) unless a --ignore regex matches the name.
Embeddings, norms, the LM head and MoE experts are copied unchanged. Magnitude keeps the two largest
|w| of every four; Wanda the two largest |w| * ||x_k||, the input-column norms measured by Kiln's float32
model on a calibration text (default: the text `kiln verify --quant-model` calibrates on).

Written (every other file of SRC_DIR is copied): config.json with a "sparsity_config"
{"format": "kiln-sparse-2:4" | "dense", "method", "ignore", "pruned"} and one model.safetensors where a
pruned weight `P.weight` becomes `P.sparse24_values` [N, K/2] (its dtype) and `P.sparse24_meta` uint8
[N, K/8] (kiln.quant.sparse24's layout); with --dense, `P.weight` holds the pruned matrix instead
(any loader reads it; nothing is saved in memory or bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from kiln.entrypoints.checkpoint_args import (
    add_checkpoint_parser,
    calibration_model,
    copy_other_files,
    is_projection_weight,
    read_calibration,
    source_safetensors,
)
from kiln.loaders.sparse import SPARSE_FORMAT


def add_parser(subparsers) -> None:
    parser = add_checkpoint_parser(
        subparsers,
        "sparsify",
        help="prune an HF checkpoint to 2:4 structured sparsity (magnitude or Wanda)",
        doc=__doc__,
        ignore_help="dense",
        calibration_help="Wanda calibration text file",
    )
    parser.add_argument("--method", choices=["magnitude", "wanda"], default="magnitude")
    parser.add_argument("--dense", action="store_true", help="write pruned weights as dense matrices")
    parser.set_defaults(func=run)


def prunable(name: str, shape: tuple[int, ...], ignore: list[re.Pattern]) -> bool:
    """Whether `kiln sparsify` prunes the checkpoint tensor `name` of `shape`."""
    return is_projection_weight(name, ignore) and len(shape) == 2 and shape[1] % 4 == 0


def wanda_norms(source: str, text: str | None, max_tokens: int) -> dict:
    """{checkpoint weight name: float32 [in_features]} measured by Kiln's float32 CPU model of `source`
    on the first `max_tokens` tokens of `text` (None: the default calibration text)."""
    from kiln.models.calibration import checkpoint_input_norms

    loaded, ids = calibration_model("kiln sparsify", source, text, max_tokens)
    return checkpoint_input_norms(loaded.model, [ids])


def sparsify(
    source: str,
    out: str,
    method: str = "magnitude",
    ignore: list[str] = (),
    calibration_text: str | None = None,
    max_calibration_tokens: int = 512,
    dense: bool = False,
    progress: bool = True,
) -> dict:
    """Prune `source` into `out` (see the module docstring). Returns the written sparsity_config."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    from kiln.quant.sparse24 import compress_24, prune_24, wanda_scores

    if method not in ("magnitude", "wanda"):
        raise ValueError(f"kiln sparsify: unknown method {method!r}, expected magnitude or wanda")
    files = source_safetensors("kiln sparsify", source, out)
    patterns = [re.compile(p) for p in ignore]
    norms = None
    if method == "wanda":
        norms = wanda_norms(source, calibration_text, max_calibration_tokens)

    os.makedirs(out, exist_ok=True)
    tensors, pruned = {}, []
    for file in files:
        with safe_open(os.path.join(source, file), framework="pt") as f:
            for name in tqdm(list(f.keys()), desc=f"sparsify {file}", disable=not progress, file=sys.stderr):
                weight = f.get_tensor(name)
                if not prunable(name, tuple(weight.shape), patterns):
                    tensors[name] = weight
                    continue
                scores = None if norms is None else wanda_scores(weight, norms[name])
                kept = prune_24(weight, scores)
                pruned.append(name)
                if dense:
                    tensors[name] = kept.contiguous()
                else:
                    prefix = name[: -len(".weight")]
                    tensors[f"{prefix}.sparse24_values"], tensors[f"{prefix}.sparse24_meta"] = compress_24(
                        kept
                    )
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    copy_other_files(source, out, {"config.json"})
    with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    sparsity = {
        "format": "dense" if dense else SPARSE_FORMAT,
        "method": method,
        "ignore": list(ignore),
        "pruned": len(pruned),
    }
    config["sparsity_config"] = sparsity
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return sparsity


def run(args: argparse.Namespace) -> int:
    text = read_calibration(args.calibration)
    try:
        config = sparsify(
            args.source, args.out, args.method, args.ignore, text, args.max_calibration_tokens, args.dense
        )
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"kiln sparsify: {config['pruned']} weights pruned 2:4 ({config['method']}) -> {args.out}")
    return 0
