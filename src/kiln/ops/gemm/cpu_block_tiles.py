"""GGUF Q4 and Q8_0 blocks in 16-row tiles for batched decode on the CPU: the tile kernels of the
"q4_blocks[_a8]_onednn" and "q8_blocks[_a8]_onednn" layouts (kiln.ops.gemm.weight_formats).

`pack_q4` copies the blocks' tensors (kiln.ops.gemm.cpu_q4_blocks.pack) once at load into tiles of 16
weight rows, each block's bytes row-interleaved, so that one 16-byte load gives the same byte of 16
rows; `q4_tiles_gemm` computes y = x @ W^T on those exact values (w = d * q + m in float32), each
output vector holding 16 outputs (no horizontal sums) and each output one float32 sum in the same
order whatever the number of rows (batch-invariant). prepared_linear and the flat decode loop give it
the rows of native_cpu.blocks_tiles_rows("q4") (8 to 32 on AVX-512 builds, 64 where the panel kernel
does not run; `layout_tiles` keeps no tiles elsewhere: on AVX2 the kernel measured slower than the
row kernel, q4_blocks_gemm).

`pack_q8` / `q8_tiles_gemm` do the same for Q8_0's values and scales (kiln.ops.gemm.cpu_q8_blocks.pack;
w = d * q, exact in float32): the LM head of a batched step, and Q8_0 models' layers.

torch.ops.kiln_cpu.q4_tiles_gemm (cpu_block_tiles.cpp) and q8_tiles_gemm (cpu_q8_tiles.cpp), part of
Kiln's native CPU library (kiln.ops.native_cpu); where the library cannot be built, the same products as
tensor code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops import native_cpu

BLOCK = 32  # weights per GGUF Q4_0 / Q4_1 block (and per Q4_K sub-block)
TILE = 16  # weight rows per tile
# what a layout keeps where no tile kernel reads tiles: empty tensors of the tiles' dtypes (read-only)
NO_TILES = (torch.empty(0, 0, dtype=torch.uint8), torch.empty(0, 0))
NO_Q8_TILES = (torch.empty(0, 0, dtype=torch.int8), torch.empty(0, 0))
_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the two ops' fakes, once per process. True when the
    native kernels run here. Call it eagerly (not while torch.compile traces)."""
    return native_cpu.load_op(_state, _register_fake)


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::q4_tiles_gemm")
    def _(x, tiles, tile_scales, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kiln_cpu::q8_tiles_gemm")
    def _(x, tiles, tile_scales, n):
        return x.new_empty((x.shape[0], n))


def _tiled(t: torch.Tensor, per_row: int) -> torch.Tensor:
    """t [N, groups * per_row] -> [ceil(N / 16), groups, per_row, 16]: each block's values of 16 rows,
    row-interleaved (rows past N zero)."""
    n, width = t.shape
    t = F.pad(t, (0, 0, 0, -n % TILE))
    return t.view(-1, TILE, width // per_row, per_row).permute(0, 2, 3, 1)


def pack_q4(
    nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q4 blocks' tensors (nibbles uint8 [N, K / 2], scales and mins float32 [N, K / 32], as
    cpu_q4_blocks.pack returns them) -> (tiles uint8 [ceil(N / 16), K / 32 * 256], tile_scales
    [ceil(N / 16), K / 32 * 32]): per tile and block, byte j of its 16 rows (j = 0..15), then the rows'
    16 d followed by their 16 m; the scales float16 where every d and m is one exactly (Q4_0, Q4_1:
    1/8 byte a weight less for the kernel to read), else float32 (Q4_K's products of two scales, as a
    rule). Loads the native kernel (`load`) first."""
    load()
    tiles = _tiled(nibbles, BLOCK // 2)
    d, m = _tiled(scales, 1), _tiled(mins, 1)
    tile_scales = torch.cat([d, m], dim=2)  # [tiles, groups, 2, 16]
    halves = tile_scales.half()
    if torch.equal(halves.float(), tile_scales):  # exact (no rounding, no overflow to inf)
        tile_scales = halves
    return tiles.reshape(tiles.shape[0], -1).contiguous(), tile_scales.reshape(d.shape[0], -1).contiguous()


def pack_q8(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0's tensors (values int8 [N, K], scales float32 [N, K / 32], as cpu_q8_blocks.pack returns
    them) -> (tiles int8 [ceil(N / 16), K * 16], tile_scales float32 [ceil(N / 16), K / 32 * 16]): per
    tile, weight k of its 16 rows for k = 0..K-1, and per block the rows' 16 d. Loads the native kernel
    (`load`) first."""
    load()
    tiles = _tiled(values, values.shape[1])  # [tiles, 1, K, 16]
    tile_scales = _tiled(scales, 1)  # [tiles, K / 32, 1, 16]
    num_tiles = tiles.shape[0]
    return tiles.reshape(num_tiles, -1).contiguous(), tile_scales.reshape(num_tiles, -1).contiguous()


def layout_tiles(*blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles a "q4_blocks[_a8]_onednn" (blocks: nibbles, scales, mins) or "q8_blocks[_a8]_onednn"
    (values, scales) layout keeps after its float32 copy: `pack_q4` / `pack_q8` where this build runs
    the tile kernel (native_cpu.blocks_tiles_rows(kind) not (0, 0): AVX-512), else `NO_TILES` /
    `NO_Q8_TILES` (no copy where no kernel reads it; nor for values with a scale per 16, Q6_K's: the
    tile kernel reads blocks of 32)."""
    q4 = len(blocks) == 3
    if not q4 and blocks[1].shape[1] * BLOCK != blocks[0].shape[1]:  # Q6_K's scales per 16: no tile kernel
        return NO_Q8_TILES
    if native_cpu.blocks_tiles_rows("q4" if q4 else "q8")[0]:
        return pack_q4(*blocks) if q4 else pack_q8(*blocks)
    return NO_TILES if q4 else NO_Q8_TILES


def tile_matrix(tiles: torch.Tensor, tile_scales: torch.Tensor, n: int) -> torch.Tensor:
    """The float64 [N, K] matrix of Q4 tiles (`pack_q4`): w = d * q + m."""
    num_tiles = tiles.shape[0]
    groups = tiles.shape[1] // (BLOCK // 2 * TILE)
    blocks = tiles.view(num_tiles, groups, BLOCK // 2, TILE).permute(0, 3, 1, 2)  # [t, row, g, byte]
    q = torch.cat([blocks & 15, blocks >> 4], dim=-1).to(torch.float64)  # weights j, then j + 16
    scales = tile_scales.to(torch.float64).view(num_tiles, groups, 2, TILE).permute(0, 3, 1, 2)
    w = q * scales[..., :1] + scales[..., 1:]
    return w.reshape(num_tiles * TILE, groups * BLOCK)[:n]


def q4_tiles_gemm(x: torch.Tensor, tiles: torch.Tensor, tile_scales: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] float (read as float32), Q4 tiles (`pack_q4`) of an [N, K] weight -> y float32 [M, N],
    y[i, j] = sum_k x[i, k] * (d[j, k // 32] * q[j, k] + m[j, k // 32])."""
    return _tiles_gemm("q4_tiles_gemm", tile_matrix, x, tiles, tile_scales, n)


def _tiles_gemm(op: str, matrix, x, tiles, tile_scales, n: int) -> torch.Tensor:
    """torch.ops.kiln_cpu.<op> on x as float32 where the native library is loaded; else x times the
    float32 `matrix(tiles, tile_scales, n)` (the same products as tensor code)."""
    x = x.float()
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return getattr(torch.ops.kiln_cpu, op)(x, tiles, tile_scales, n)
    return x @ matrix(tiles, tile_scales, n).to(torch.float32).T


def q8_tile_matrix(tiles: torch.Tensor, tile_scales: torch.Tensor, n: int) -> torch.Tensor:
    """The float64 [N, K] matrix of Q8_0 tiles (`pack_q8`): w = d * q."""
    num_tiles = tiles.shape[0]
    k = tiles.shape[1] // TILE
    q = tiles.view(num_tiles, k, TILE).transpose(1, 2).to(torch.float64)  # [t, row, k]
    d = tile_scales.to(torch.float64).view(num_tiles, k // BLOCK, TILE).transpose(1, 2)  # [t, row, g]
    w = q * d.repeat_interleave(BLOCK, dim=2)
    return w.reshape(num_tiles * TILE, k)[:n]


def q8_tiles_gemm(x: torch.Tensor, tiles: torch.Tensor, tile_scales: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] float (read as float32), Q8_0 tiles (`pack_q8`) of an [N, K] weight -> y float32 [M, N],
    y[i, j] = sum_k x[i, k] * d[j, k // 32] * q[j, k], each output summed over k in order."""
    return _tiles_gemm("q8_tiles_gemm", q8_tile_matrix, x, tiles, tile_scales, n)
