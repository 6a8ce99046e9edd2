"""Rows of a GGUF-quantized table, decoded when looked up (cpu_gguf_rows.cpp): what an embedding
needs to keep the file's blocks instead of a float32 copy of the whole table (llama.cpp keeps its
token embeddings quantized the same way). Each value is ggml's float32 decode, bit for bit
(`gguf.quants.dequantize`, kiln.quant.gguf_blocks.dequantize_blocks). The op is part of Kiln's native
CPU library (kiln.ops.native_cpu); where it cannot be built the rows are decoded by dequantize_blocks.
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, dequantize_blocks

QTYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # the native decodes
_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the op's fake, once per process. True when the
    native decode runs here. Call it eagerly (not while torch.compile traces)."""
    return native_cpu.load_op(_state, _register_fake)


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::gguf_rows")
    def _(blocks, ids, qtype):
        qtype_name = next(name for name, value in QTYPE_IDS.items() if value == qtype)
        k = blocks.shape[1] // BLOCK_BYTES[qtype_name] * BLOCK_WEIGHTS[qtype_name]
        return blocks.new_empty((ids.shape[0], k), dtype=torch.float32)


def gguf_rows(blocks: torch.Tensor, ids: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [T, K]: rows `ids` (int64 [T], each in [0, V)) of the table whose GGUF blocks of type
    `qtype` are `blocks` (uint8 [V, row_bytes]), decoded as ggml decodes them."""
    if not torch.compiler.is_compiling():
        load()
    if qtype in QTYPE_IDS and _state["loaded"] and blocks.device.type == "cpu":
        return torch.ops.kiln_cpu.gguf_rows(blocks, ids.long(), QTYPE_IDS[qtype])
    return dequantize_blocks(blocks[ids], qtype, torch.float32)
