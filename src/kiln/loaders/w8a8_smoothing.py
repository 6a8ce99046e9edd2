"""SmoothQuant for the CPU W8A8 formats ("w8a8", "int4_w8a8", "int8_blocks_w8a8"), applied at load.

Per-row int8 activations lose most where a few input columns peak far above the rest (SmolLM2-135M:
peaks 11-30x a row's rms). One prefill of Kiln's calibration text measures each decoder Linear's
input column peaks; each W8A8 weight's int8 copy is then rebuilt for W / smooth with x * smooth in the
op (kiln.ops.gemm.cpu_w8a8.smoothing_factors, alpha 0.5 as in the paper), which flattens the
activation peaks into the weight columns. The product is unchanged in exact arithmetic; only the
rounding moves. One-row calls of the hybrid formats (int4 / exact Q8_0) are untouched, as is the LM
head (not a decoder layer; its W8A8 copy measured no perplexity loss unsmoothed).
"""

from __future__ import annotations

import logging
import time

import torch

from kiln.models.calibration import linear_input_peaks, read_text
from kiln.ops.gemm.weight_formats import W8A8_COPY_AT, smooth_w8a8

logger = logging.getLogger(__name__)

SMOOTHING_ALPHA = 0.5
CALIBRATION_TOKENS = 512  # the whole shipped text on SmolLM2's tokenizer (225 tokens)


def w8a8_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{name: module} of the decoder Linears whose weight has a W8A8 copy."""
    return {
        name: module
        for name, module in model.named_modules()
        if name.startswith("layers.")
        and getattr(getattr(module, "prepared", None), "layout", None) in W8A8_COPY_AT
    }


def smooth_w8a8_linears(model: torch.nn.Module, tokenizer, alpha: float = SMOOTHING_ALPHA) -> int:
    """Calibrate and rebuild every W8A8 copy of `model`'s decoder Linears (see the module docstring);
    returns how many were rebuilt (0: none to do, nothing run)."""
    linears = w8a8_linears(model)
    if not linears:
        return 0
    start = time.perf_counter()
    ids = tokenizer.encode(read_text("calibration.txt"), add_special_tokens=True)[:CALIBRATION_TOKENS]
    if not ids:  # a tokenizer without this text's pieces (tests' tiny vocabularies): nothing to run
        logger.warning(
            "W8A8: the tokenizer gives no calibration tokens; %d linears left unsmoothed", len(linears)
        )
        return 0
    with torch.inference_mode():
        peaks = linear_input_peaks(model, [ids])
    for name, module in linears.items():
        if name not in peaks:  # not reached by a prefill (no such layer in Kiln's models today)
            logger.warning("W8A8: %s saw no calibration input; left unsmoothed", name)
            continue
        module.prepared = smooth_w8a8(module.prepared, peaks[name], alpha)
    logger.info(
        "W8A8: %d linears smoothed (SmoothQuant, alpha %.2f) on %d calibration tokens in %.1f s",
        len(linears), alpha, len(ids), time.perf_counter() - start,
    )  # fmt: skip
    return len(linears)
