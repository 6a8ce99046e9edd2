"""Quantized HF checkpoints: config.json's `quantization_config` read, and each quantized Linear's
stored tensors combined into one weight under its `<module>.weight` name, so model code reads
`weights.get("...q_proj.weight", (N, K))` for quantized and dense checkpoints alike.

    quant_method          tensors of a module                          becomes
    "compressed-tensors"  FP8  weight, weight_scale (+ input_scale)    ScaledWeight "fp8"
                          INT8 weight, weight_scale (+ input_scale)    ScaledWeight "int8"
                          int4 weight_packed, weight_scale,            Int4Weight (W4A16)
                               weight_shape (+ weight_zero_point)
                          FP8 block weight, weight_scale               BlockFP8Weight
    "fp8"                 weight, weight_scale_inv [N/bn, K/bk]        BlockFP8Weight
                          (weight_block_size [bn, bk])
                          weight, weight_scale (+ input_scale)         ScaledWeight "fp8" (per tensor)
    "awq" (version gemm)  qweight, qzeros, scales                      Int4Weight
    "gptq" (bits 4)       qweight, qzeros, scales, g_idx               Int4Weight (act-order: perm)
Weight-only FP8 / INT8 (no activation quantization in the scheme) are dequantized here, once, to
the checkpoint's float dtype: no Kiln kernel takes 8-bit weights with unquantized activations for
these formats. Anything else (another quant_method, bit width, strategy, a Linear whose tensors
disagree with the config) is a ModelLoadError naming the tensor, the format and what is supported.
How each weight runs per device: kiln.ops.gemm.weight_formats.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch

from kiln.loaders.config_checks import is_int
from kiln.models.config import ModelLoadError
from kiln.ops.gemm.quantized_layouts import FP8_BLOCK_SIZES
from kiln.quant.awq import awq_to_int4
from kiln.quant.compressed_tensors import block_fp8_weight, pack_quantized_int4, scaled_weight
from kiln.quant.gptq import gptq_to_int4

logger = logging.getLogger(__name__)

SUPPORTED = {
    "compressed-tensors": "FP8 (tensor/channel weights, dynamic per-token or static per-tensor "
    "activations), INT8 W8A8 (channel/tensor weights), W4A16 pack-quantized (4-bit, group 32/64/128 or "
    "multiples of 128, symmetric or asymmetric), FP8 block weights",
    "fp8": "block FP8 (weight_block_size 128x128, weight_scale_inv) or per-tensor FP8 (weight_scale)",
    "awq": "4-bit GEMM version (qweight/qzeros/scales)",
    "gptq": "4-bit (qweight/qzeros/scales/g_idx, sym or asym, act-order)",
}
# stored suffix -> the module's tensors each method reads
_MARKERS = {
    "compressed-tensors": ("weight_scale", "weight_packed"),
    "fp8": ("weight_scale_inv", "weight_scale"),
    "awq": ("qweight",),
    "gptq": ("qweight",),
}

Loaders = dict[str, tuple[tuple[int, ...], Callable[[], object]]]


def quantized_loaders(hf: dict, loaders: Loaders, source: str) -> Loaders:
    """`loaders` (name -> (shape, load)) with every quantized Linear's tensors replaced by one entry
    `<module>.weight` -> ((N, K), load the combined weight). Unchanged without a quantization_config."""
    qc = hf.get("quantization_config")
    if qc is None:
        return loaders
    where = f"{source}/config.json"
    if not isinstance(qc, dict) or not isinstance(qc.get("quant_method"), str):
        raise ModelLoadError(f"{where}: quantization_config must be an object with a quant_method")
    method = qc["quant_method"]
    if method not in SUPPORTED:
        supported = "; ".join(f"{m}: {what}" for m, what in SUPPORTED.items())
        raise ModelLoadError(f"{where}: quant_method {method!r} is not supported. Kiln loads {supported}")
    modules = sorted(
        {name.rsplit(".", 1)[0] for name in loaders if name.rsplit(".", 1)[-1] in _MARKERS[method]}
    )
    out = dict(loaders)
    get = {name: load for name, (_, load) in loaders.items()}
    shapes = {name: shape for name, (shape, _) in loaders.items()}
    for module in modules:
        build = _builder(method, qc, module, get, shapes, source)
        if build is None:
            continue
        shape, load, consumed = build
        for name in consumed:
            out.pop(name, None)
        out[f"{module}.weight"] = (shape, _named(load, module, method, source))
    if modules:
        logger.info("%s: %d quantized linear weights (%s)", source, len(modules), method)
    return out


def _named(load: Callable[[], object], module: str, method: str, source: str) -> Callable[[], object]:
    def run():
        try:
            return load()
        except ValueError as exc:
            raise ModelLoadError(
                f"{source}: {method} weight {module!r}: {exc}. Kiln loads {SUPPORTED[method]}"
            ) from exc

    return run


def _unsupported(source: str, module: str, method: str, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{source}: tensor {module + '.weight'!r}: {method} {what} is not supported. "
        f"Kiln loads {SUPPORTED[method]}"
    )


def _group_size_ok(value) -> bool:
    """An integer group size: -1 (one group a row) or positive (a JSON null or 0 is neither)."""
    return is_int(value) and (value == -1 or value > 0)


def _builder(method, qc, module, get, shapes, source):
    """(shape, load, consumed names) for one module, or None where it is not a quantized Linear.
    get / shapes: every tensor's loader and shape by name (built once for all modules)."""

    def tensor(suffix: str, required: bool = True) -> Callable[[], torch.Tensor] | None:
        name = f"{module}.{suffix}"
        if name not in get:
            if required:
                raise ModelLoadError(f"{source}: missing tensor {name!r} ({method} checkpoint)")
            return None
        return get[name]

    def names(*suffixes: str) -> list[str]:
        return [f"{module}.{s}" for s in suffixes if f"{module}.{s}" in get]

    if method == "compressed-tensors":
        return _compressed_tensors(qc, module, tensor, names, shapes, source)
    if method == "fp8":
        return _fp8(qc, module, tensor, names, shapes, source)
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise _unsupported(source, module, method, f"bits={bits}")
    group_size = qc.get("group_size", qc.get("q_group_size", 128))
    if not _group_size_ok(group_size):
        raise _unsupported(source, module, method, f"group_size={group_size!r}")
    qweight_shape = shapes[f"{module}.qweight"]
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _unsupported(source, module, method, f"version {version!r}")
        shape = (qweight_shape[1] * 8, qweight_shape[0])
        q, z, s = tensor("qweight"), tensor("qzeros"), tensor("scales")
        return shape, lambda: awq_to_int4(q(), z(), s(), group_size), names("qweight", "qzeros", "scales")
    shape = (qweight_shape[1], qweight_shape[0] * 8)
    q, z, s, g = tensor("qweight"), tensor("qzeros"), tensor("scales"), tensor("g_idx", False)
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        fmt = "marlin" if qc.get("is_marlin_format") else checkpoint_format
        raise _unsupported(source, module, method, f"checkpoint_format {fmt!r} (Kiln loads gptq and gptq_v2)")
    if qc.get("dynamic"):  # GPTQModel's per-module overrides of bits, group size, desc_act
        raise _unsupported(source, module, method, "a per-module 'dynamic' override")
    plus_one = checkpoint_format != "gptq_v2"
    if qc.get("desc_act", False) and g is None:
        raise ModelLoadError(
            f"{source}: missing tensor {module + '.g_idx'!r} (gptq checkpoint with desc_act)"
        )

    def load_gptq():  # g_idx as stored, whatever desc_act says (a plain one is no permutation)
        g_idx = g() if g is not None else None
        return gptq_to_int4(q(), z(), s(), g_idx, group_size, zeros_plus_one=plus_one)

    return shape, load_gptq, names("qweight", "qzeros", "scales", "g_idx")


def _scheme_for(qc: dict, module: str):
    """The config group whose targets match `module`, or None when the module is ignored or matched
    by no group. As compressed-tensors ranks them: a target naming the module outranks a regex
    ("re:<regex>"), which outranks the class ("Linear"); among equals the first group."""
    for pattern in qc.get("ignore") or []:
        if _matches(pattern, module):
            return None
    best, best_rank = None, 3
    for group in (qc.get("config_groups") or {}).values():
        for target in group.get("targets") or []:
            if target == "Linear":
                rank = 2
            elif target.startswith("re:"):
                rank = 1 if re.match(target[3:], module) else 3
            else:
                rank = 0 if target == module else 3
            if rank < best_rank:
                best, best_rank = group, rank
    return best


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def _compressed_tensors(qc, module, tensor, names, shapes, source):
    method = "compressed-tensors"
    group = _scheme_for(qc, module)
    if group is None:
        return None
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    fmt = group.get("format") or qc.get("format")
    wtype, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    describe = f"{fmt} {wtype} {bits}-bit {strategy} weights with {_describe_acts(acts)}"
    if fmt == "pack-quantized" and wtype == "int" and bits == 4 and acts is None:
        if strategy not in ("group", "channel"):
            raise _unsupported(source, module, method, describe)
        group_size = weights.get("group_size") if strategy == "group" else -1
        if not _group_size_ok(group_size):
            raise _unsupported(source, module, method, f"group_size {group_size!r} ({describe})")
        packed, scale = tensor("weight_packed"), tensor("weight_scale")
        zp = tensor("weight_zero_point") if not weights.get("symmetric", True) else None
        # actorder "group" (GPTQ with act-order, as llm-compressor wrote it before 2026-08): each input's
        # group in weight_g_idx
        g_idx = tensor("weight_g_idx", weights.get("actorder") == "group")
        rows, words = shapes[f"{module}.weight_packed"]
        shape_t = tensor("weight_shape", False)
        # weight_shape holds K exactly (2 values, read now for the WeightStore's shape check)
        k = int(shape_t()[1]) if shape_t is not None else words * 8

        if zp is None:  # symmetric: a stored zero point must be zero
            stored = ((tensor("weight_zero_point", False), "weight_zero_point"),)
            packed = _zero_checked(packed, stored, module, describe)

        def load_int4():
            zero = zp() if zp else None
            return pack_quantized_int4(
                packed(), scale(), k, group_size, zero, module, g_idx() if g_idx else None
            )

        consumed = names("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
        return (rows, k), load_int4, consumed
    if fmt not in ("float-quantized", "naive-quantized", "int-quantized") or bits != 8:
        raise _unsupported(source, module, method, describe)
    qtype = {"float": "fp8", "int": "int8"}.get(wtype)
    if qtype is None or not weights.get("symmetric", True):
        raise _unsupported(source, module, method, describe)
    w, scale = tensor("weight"), tensor("weight_scale")
    shape = tuple(shapes[f"{module}.weight"])
    consumed = names("weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point")
    w_zero, x_zero = tensor("weight_zero_point", False), tensor("input_zero_point", False)
    if w_zero is not None or x_zero is not None:  # symmetric: stored zero points must be zero
        w = _zero_checked(w, ((w_zero, "weight_zero_point"), (x_zero, "input_zero_point")), module, describe)
    if strategy == "block":
        block = tuple(weights.get("block_structure") or ())
        if qtype != "fp8" or len(block) != 2 or not _block_acts(acts, block[1]):
            raise _unsupported(source, module, method, describe)
        _check_fp8_block(block, source, module, method)
        return shape, lambda: block_fp8_weight(w(), scale(), block, module), consumed
    if strategy not in ("tensor", "channel"):
        raise _unsupported(source, module, method, describe)
    if acts is None:  # weight-only 8-bit: dequantized (see the module docstring)
        return (
            shape,
            _dequantized(lambda: scaled_weight(qtype, w(), scale(), None, module), source, describe),
            consumed,
        )
    if acts.get("type") != wtype or acts.get("num_bits") != 8 or not acts.get("symmetric", True):
        raise _unsupported(source, module, method, describe)
    if acts.get("dynamic") is True and acts.get("strategy") == "token":
        return shape, lambda: scaled_weight(qtype, w(), scale(), None, module), consumed
    if acts.get("dynamic") is False and acts.get("strategy") == "tensor":
        x_scale = tensor("input_scale")
        return shape, lambda: scaled_weight(qtype, w(), scale(), x_scale(), module), consumed
    raise _unsupported(source, module, method, describe)


def _check_fp8_block(block: tuple, source: str, module: str, method: str) -> None:
    """Kiln's block-FP8 GEMM takes the blocks of FP8_BLOCK_SIZES: others fail here, by name, not at
    the first forward."""
    if tuple(block) not in FP8_BLOCK_SIZES:
        sizes = ", ".join(f"{bn}x{bk}" for bn, bk in FP8_BLOCK_SIZES)
        what = f"FP8 blocks of {block[0]}x{block[1]} (Kiln takes {sizes})"
        raise _unsupported(source, module, method, what)


def _zero_checked(load, zeros, module: str, describe: str):
    """load, after checking that each stored (loader or None, name) zero point is zero: a symmetric
    scheme's nonzero zero point belongs to another scheme."""

    def run():
        for zero, name in zeros:
            if zero is not None and bool((zero() != 0).any()):
                raise ValueError(f"{module}.{name} holds nonzero zero points; the scheme ({describe}) is "
                                 "symmetric")  # fmt: skip
        return load()

    return run


def _describe_acts(acts) -> str:
    if acts is None:
        return "unquantized activations"
    kind = "dynamic" if acts.get("dynamic") else "static"
    return f"{kind} {acts.get('type')} {acts.get('num_bits')}-bit {acts.get('strategy')} activations"


def _block_acts(acts, block_k) -> bool:
    return (
        acts is not None and acts.get("type") == "float" and acts.get("num_bits") == 8
        and bool(acts.get("dynamic")) and acts.get("strategy") == "group"
        and acts.get("group_size") == block_k
    )  # fmt: skip


def _dequantized(load, source, describe):
    def run():
        weight = load()
        logger.info("%s: %s: dequantized once at load (no kernel for this scheme)", source, describe)
        return weight.dequantize(torch.float32)

    return run


def _fp8(qc, module, tensor, names, shapes, source):
    method = "fp8"
    if f"{module}.weight" not in shapes:
        return None
    block = qc.get("weight_block_size")
    w = tensor("weight")
    shape = tuple(shapes[f"{module}.weight"])
    if block is not None:
        if len(block) != 2:
            raise _unsupported(source, module, method, f"weight_block_size {block}")
        _check_fp8_block(tuple(block), source, module, method)
        scale = tensor("weight_scale_inv", False) or tensor("weight_scale")
        return (
            shape,
            lambda: block_fp8_weight(w(), scale(), tuple(block), module),
            names("weight", "weight_scale_inv", "weight_scale"),
        )
    scale = tensor("weight_scale")
    static = qc.get("activation_scheme", "dynamic") == "static"
    x_scale = tensor("input_scale") if static else None
    return (
        shape,
        lambda: scaled_weight("fp8", w(), scale(), x_scale() if x_scale else None, module),
        names("weight", "weight_scale", "input_scale"),
    )
