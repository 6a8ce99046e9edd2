"""Rows of a GGUF-quantized table, decoded when looked up (cpu_gguf_rows.cpp): what an embedding
needs to keep the file's blocks instead of a float32 copy of the whole table (llama.cpp keeps its
token embeddings quantized the same way). Each value is ggml's float32 decode, bit for bit
(`gguf.quants.dequantize`, kiln.quant.gguf_blocks.dequantize_blocks). The op is part of Kiln's native
CPU library (kiln.ops.native_cpu); where it cannot be built the rows are decoded by dequantize_blocks.
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, GGML_TYPE_IDS, dequantize_blocks

# the types the native op decodes, by GGML type id
QTYPE_IDS = {qtype: GGML_TYPE_IDS[qtype] for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}
_QTYPES_BY_ID = {v: k for k, v in QTYPE_IDS.items()}
_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the op's fake, once per process. True when the
    native decode runs here. Call it eagerly (not while torch.compile traces)."""
    return native_cpu.load_op(_state, _register_fake)


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::gguf_rows")
    def _(blocks, ids, qtype):
        qtype_name = _QTYPES_BY_ID[qtype]
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
