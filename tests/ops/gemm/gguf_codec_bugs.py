"""Plausible mistakes planted in kiln.quant.gguf_blocks, the codec the CPU paths of gguf_dequantize and
gguf_linear run: `kiln verify` must fail them, because the references decode with the gguf package."""

import torch

import kiln.quant.gguf_blocks as gguf_blocks

# helper -> the qtypes whose decode goes through it
PLANTED_HELPERS = {
    "_half": ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"),
    "_nibbles": ("Q4_0", "Q4_1", "Q5_0"),
    "_k4_scales_mins": ("Q4_K", "Q5_K"),
}
PLANTED_CASES = [(helper, qtype) for helper, qtypes in PLANTED_HELPERS.items() for qtype in qtypes]


def plant_gguf_codec_bug(monkeypatch, helper: str) -> None:
    """Replace kiln.quant.gguf_blocks.<helper> by a wrong version of it (monkeypatch undoes it)."""
    real = getattr(gguf_blocks, helper)
    planted = {
        "_half": lambda two_bytes: two_bytes.contiguous().view(torch.bfloat16),  # fp16 fields read as bf16
        "_nibbles": lambda qs: real(qs).roll(16, dims=-1),  # weight j taken from the high nibble
        "_k4_scales_mins": lambda scales: real(scales)[::-1],  # the 6-bit mins read as the scales
    }[helper]
    monkeypatch.setattr(gguf_blocks, helper, planted)
