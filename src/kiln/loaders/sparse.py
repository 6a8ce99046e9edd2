"""2:4 sparse HF checkpoints written by `kiln sparsify`: config.json's `sparsity_config` read, and each
pruned Linear's `<module>.sparse24_values` / `<module>.sparse24_meta` combined into one
kiln.quant.sparse24.Sparse24Weight under `<module>.weight`, so model code reads it like a dense weight.

    sparsity_config.format    what the file holds                      becomes
    "kiln-sparse-2:4"         P.sparse24_values [N, K/2], P.sparse24_meta   Sparse24Weight [N, K]
                              uint8 [N, ceil(K/8)]
    "dense"                   P.weight, already pruned                 (nothing to do)
How it runs per device: kiln.ops.gemm.weight_formats (sparse24_linear on CUDA, dense on the CPU).
"""

from __future__ import annotations

import logging

from kiln.models.config import ModelLoadError
from kiln.quant.sparse24 import Sparse24Weight, positions_24

logger = logging.getLogger(__name__)

SPARSE_FORMAT = "kiln-sparse-2:4"
FORMATS = (SPARSE_FORMAT, "dense")


def sparse_loaders(hf: dict, loaders: dict, source: str) -> dict:
    """`loaders` (name -> (shape, load)) with every pruned Linear's values + meta replaced by one entry
    `<module>.weight` -> ((N, K), load a Sparse24Weight). Unchanged without a sparsity_config."""
    sc = hf.get("sparsity_config")
    if sc is None:
        return loaders
    where = f"{source}/config.json"
    fmt = sc.get("format") if isinstance(sc, dict) else None
    if fmt not in FORMATS:
        raise ModelLoadError(
            f"{where}: sparsity_config format {fmt!r} is not supported; Kiln loads {', '.join(FORMATS)} "
            "(written by `kiln sparsify`)"
        )
    if fmt == "dense":
        return loaders
    if hf.get("quantization_config") is not None:
        raise ModelLoadError(f"{where}: a 2:4 sparse checkpoint with a quantization_config is not supported")
    out = dict(loaders)
    modules = sorted(
        name[: -len(".sparse24_values")] for name in loaders if name.endswith(".sparse24_values")
    )
    for module in modules:
        values_name, meta_name = f"{module}.sparse24_values", f"{module}.sparse24_meta"
        if meta_name not in loaders:
            raise ModelLoadError(f"{source}: tensor {values_name!r} has no {meta_name!r}")
        (v_shape, load_values), (m_shape, load_meta) = loaders[values_name], loaders[meta_name]
        if len(v_shape) != 2 or tuple(m_shape) != (v_shape[0], -(-2 * v_shape[1] // 8)):
            raise ModelLoadError(
                f"{source}: {module!r} 2:4 tensors have shapes values {tuple(v_shape)}, meta "
                f"{tuple(m_shape)}; expected values [N, K/2] and meta [N, ceil(K/8)]"
            )

        def load(load_values=load_values, load_meta=load_meta, module=module):
            try:
                weight = Sparse24Weight(load_values(), load_meta())
                positions_24(weight.values, weight.meta)  # rejects corrupt positions now, naming the tensor
            except ValueError as exc:
                raise ModelLoadError(f"{source}: 2:4 weight {module!r}: {exc}") from exc
            return weight

        del out[values_name], out[meta_name]
        out[f"{module}.weight"] = ((v_shape[0], 2 * v_shape[1]), load)
    logger.info("%s: %d 2:4 sparse linear weights", source, len(modules))
    return out
