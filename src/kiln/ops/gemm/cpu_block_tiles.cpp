// The tile kernel of the "q4_blocks[_a8]_onednn" layouts (kiln.ops.gemm.weight_formats): y = x @ W^T
// for several rows of x (batched decode: prepared_linear and FlatDecode give it the rows of
// native_cpu.blocks_tiles_rows("q4"), 8 to 32 on AVX-512 builds, 64 without the panel kernel) on the
// GGUF Q4 blocks' exact values, from a copy of the blocks made at load in 16-row tiles
// (kiln.ops.gemm.cpu_block_tiles.pack_q4):
//
//   tiles uint8 [ceil(N / 16), K / 32 * 256]: tile t, block g, byte j, row i holds byte j of row
//       16 t + i's block g (low nibble weight 32 g + j, high nibble weight 32 g + j + 16);
//   tile_scales float16 or float32 [ceil(N / 16), K / 32 * 32]: d of the 16 rows' block g, then their
//       m; float16 where every d and m is one exactly (Q4_0 / Q4_1: the file's own; Q4_K's products of
//       a super-block scale and a 6-bit one often are not): 1/8 byte a weight less to read, which on
//       SmolLM2's 120 layer matrices cache-cold (2-core Zen 5) took 6.60 -> 5.89 ms at 8 rows, 10.72 ->
//       10.15 at 16, 18.82 -> 18.27 at 32, the same floats.
//
// Rows past N (padding) have zero scales. Each step loads byte j of 16 rows, turns its nibbles into
// float32 weights w = fma(q, d, m) (one rounding: the float32 copy's values) and multiplies them by one
// broadcast value of each x row: an accumulator holds 16 outputs, so no horizontal sum ends a row and x
// is read a float at a time. (The row kernel, q4_blocks_gemm, vectorizes along K: each output ends in a
// 16-lane reduction, which at K = 576 costs about a quarter of the arithmetic, and each FMA loads a
// vector of x; it keeps 2-7 rows, where converting each weight for few rows costs the tiles more.)
// Every output is one float32 sum over k in the same order (block by block; in a block weights j and
// j + 16 in turn, j = 0..15) whatever the number of rows in the call: batch-invariant; the scalar build
// runs the same sums in the same order.
// Registered as torch.ops.kiln_cpu.q4_tiles_gemm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_float_lanes.h"
#include "native_cpu_ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;        // weights per GGUF Q4 block
constexpr int64_t kTile = 16;         // weight rows per tile
constexpr int64_t kSteps = 16;        // bytes per row per block: a step takes one, two weights
constexpr int64_t kBlockBytes = kSteps * kTile, kBlockScales = 2 * kTile;  // a tile's, per block

#if defined(KILN_FLOAT_LANES)
using namespace kiln_cpu::lanes;  // Floats: kLanes floats, 16 (AVX-512) or 8 (AVX2)
constexpr int kParts = kTile / kLanes;  // vectors a tile row of 16 outputs takes
// Tiles and x rows a pass: AVX-512 2 tiles x 8 rows (16 accumulators of its 32 registers; 12 rows
// spilled and measured no faster over SmolLM2's matrices), AVX2 1 tile (2 vectors) x 6 rows
constexpr int kPassTiles = kLanes == 16 ? 2 : 1;
constexpr int kVectors = kPassTiles * kParts;  // output vectors a pass
constexpr int kMaxRows = kLanes == 16 ? 8 : 6;

// R rows of x against the kPassTiles tiles from `tiles` (`tile_bytes` apart; their scales `tile_scales`
// apart): out[r][v] for x row r and output vector v. xs: the rows' values in the order the steps take
// them, kMaxRows floats a weight (every broadcast reads from one pointer: with a pointer per row the
// compiler ran out of registers).
// S: the scales' type, float or c10::Half (kiln_cpu::lanes::load widens either).
template <int R, typename S>
void pass(const float* xs, const uint8_t* tiles, int64_t tile_bytes, const S* scales, int64_t tile_scales,
          int64_t groups, Floats (&out)[kMaxRows][kVectors]) {
  Floats acc[R][kVectors];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVectors; ++v) acc[r][v] = zero();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = xs + g * kBlock * kMaxRows;
    for (int step = 0; step < kSteps; ++step) {
      Floats lo[kVectors], hi[kVectors];  // weights j and j + 16 of 16 rows (kParts vectors a tile)
      for (int v = 0; v < kVectors; ++v) {
        const int64_t tile = v / kParts, lanes = (v % kParts) * kLanes;
        const S* dm = scales + tile * tile_scales + g * kBlockScales + lanes;
        const Floats d = load(dm), m = load(dm + kTile);
        nibbles(tiles + tile * tile_bytes + g * kBlockBytes + step * kTile + lanes, lo[v], hi[v]);
        lo[v] = fmadd(lo[v], d, m);
        hi[v] = fmadd(hi[v], d, m);
      }
      const float* xl = xg + 2 * step * kMaxRows;  // weight j of each row, then weight j + 16
      for (int r = 0; r < R; ++r) {
        const Floats xb = set1(xl[r]);
        for (int v = 0; v < kVectors; ++v) acc[r][v] = fmadd(lo[v], xb, acc[r][v]);
      }
      for (int r = 0; r < R; ++r) {
        const Floats xb = set1(xl[kMaxRows + r]);
        for (int v = 0; v < kVectors; ++v) acc[r][v] = fmadd(hi[v], xb, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVectors; ++v) out[r][v] = acc[r][v];
  }
}

template <typename S>
using Pass = void (*)(const float*, const uint8_t*, int64_t, const S*, int64_t, int64_t,
                      Floats (&)[kMaxRows][kVectors]);
template <typename S, size_t... R>
constexpr std::array<Pass<S>, kMaxRows + 1> pass_table(std::index_sequence<R...>) {
  return {nullptr, pass<R + 1, S>...};
}
template <typename S>
constexpr auto kPasses = pass_table<S>(std::make_index_sequence<kMaxRows>());  // [R]: R x rows
constexpr int64_t kTaskTiles = kPassTiles;

// Into L1, a line at a time: the next task's tiles and scales, asked for once this task's first pass is
// done (with more than kMaxRows rows; else as it starts) so that its later passes cover the wait. A
// matrix is a short stream (SmolLM2's are 0.3-1 MB a thread) which the hardware prefetchers follow
// late: 120 of them cache-cold on a 2-core Zen 5 at 16 rows, 10.4 ms against 11.0-11.3 (8.6 warm);
// two tasks ahead, or into L2 only, did less.
void prefetch_lines(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}
#else
constexpr int64_t kTaskTiles = 1;
#endif

// The product once the arguments are checked: x, tiles and tile_scales contiguous, the scales of type S.
template <typename S>
at::Tensor tiles_gemm(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales, int64_t n) {
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kBlock, num_tiles = (n + kTile - 1) / kTile;
  const int64_t tile_bytes = groups * kBlockBytes, scales_per_tile = groups * kBlockScales;
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const S* sp = reinterpret_cast<const S*>(tile_scales.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t tasks = (num_tiles + kTaskTiles - 1) / kTaskTiles;
#if defined(KILN_FLOAT_LANES)
  // x's rows kMaxRows at a time, each chunk [K][kMaxRows] in the order the steps read them
  const int64_t chunks = (rows + kMaxRows - 1) / kMaxRows;
  std::vector<float> packed(chunks * k * kMaxRows);
  for (int64_t r = 0; r < rows; ++r) {
    float* chunk = packed.data() + (r / kMaxRows) * k * kMaxRows + r % kMaxRows;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t step = 0; step < kSteps; ++step) {
        chunk[(g * kBlock + 2 * step) * kMaxRows] = xp[r * k + g * kBlock + step];
        chunk[(g * kBlock + 2 * step + 1) * kMaxRows] = xp[r * k + g * kBlock + step + 16];
      }
    }
  }
#endif
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile0 = task * kTaskTiles;
#if defined(KILN_FLOAT_LANES)
      // a task's last tiles may lie past the tensor: point them at its first tile (their outputs are
      // not written) so that every pass reads kPassTiles tiles
      const int64_t row0 = tile0 * kTile, width = std::min<int64_t>(kPassTiles * kTile, n - row0);
      const int64_t step = tile0 + 1 < num_tiles ? tile_bytes : 0, scale_step = step ? scales_per_tile : 0;
      Floats out[kMaxRows][kVectors];
      float buffer[kVectors * kLanes];
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        if (r == (rows > kMaxRows ? kMaxRows : 0) && task + 1 < end) {
          const int64_t next = tile0 + kTaskTiles, next_tiles = std::min<int64_t>(kTaskTiles, num_tiles - next);
          prefetch_lines(tp + next * tile_bytes, next_tiles * tile_bytes);
          prefetch_lines(sp + next * scales_per_tile, next_tiles * scales_per_tile * sizeof(S));
        }
        const int64_t count = std::min<int64_t>(kMaxRows, rows - r);
        kPasses<S>[count](packed.data() + (r / kMaxRows) * k * kMaxRows, tp + tile0 * tile_bytes, step,
                       sp + tile0 * scales_per_tile, scale_step, groups, out);
        for (int64_t i = 0; i < count; ++i) {
          float* yr = yp + (r + i) * n + row0;
          if (width == kVectors * kLanes) {
            for (int v = 0; v < kVectors; ++v) store(yr + v * kLanes, out[i][v]);
          } else {
            for (int v = 0; v < kVectors; ++v) store(buffer + v * kLanes, out[i][v]);
            std::memcpy(yr, buffer, width * sizeof(float));
          }
        }
      }
#else
      const int64_t width = std::min<int64_t>(kTile, n - tile0 * kTile);
      const uint8_t* tile = tp + tile0 * tile_bytes;
      const S* scales = sp + tile0 * scales_per_tile;
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + r * k;
        for (int64_t i = 0; i < width; ++i) {
          float acc = 0.f;
          for (int64_t g = 0; g < groups; ++g) {
            const float d = static_cast<float>(scales[g * kBlockScales + i]);
            const float m = static_cast<float>(scales[g * kBlockScales + kTile + i]);
            for (int64_t step = 0; step < kSteps; ++step) {
              const uint8_t b = tile[g * kBlockBytes + step * kTile + i];
              acc = std::fma(std::fma(static_cast<float>(b & 15), d, m), xr[g * kBlock + step], acc);
              acc = std::fma(std::fma(static_cast<float>(b >> 4), d, m), xr[g * kBlock + step + 16], acc);
            }
          }
          yp[r * n + tile0 * kTile + i] = acc;
        }
      }
#endif
    }
  });
  return y;
}

}  // namespace

namespace kiln_cpu {

at::Tensor q4_tiles_gemm(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales, int64_t n) {
  const char* op = "q4_tiles_gemm";
  TORCH_CHECK(x.device().is_cpu() && tiles.device().is_cpu() && tile_scales.device().is_cpu(), op,
              ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, op, ": x must be float32 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kBlock, num_tiles = (n + kTile - 1) / kTile;
  const int64_t tile_bytes = groups * kBlockBytes, scales_per_tile = groups * kBlockScales;
  TORCH_CHECK(k % kBlock == 0 && n > 0, op, ": K = ", k, " must be a multiple of 32 and N = ", n, " positive");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 2 && tiles.size(0) == num_tiles &&
                  tiles.size(1) == tile_bytes,
              op, ": tiles must be uint8 [ceil(N / 16), K / 32 * 256] = [", num_tiles, ", ", tile_bytes,
              "] for K = ", k, ", N = ", n, ", got ", tiles.scalar_type(), " ", tiles.sizes());
  TORCH_CHECK((tile_scales.scalar_type() == at::kFloat || tile_scales.scalar_type() == at::kHalf) &&
                  tile_scales.dim() == 2 && tile_scales.size(0) == num_tiles && tile_scales.size(1) == scales_per_tile,
              op, ": tile_scales must be float32 or float16 [", num_tiles, ", ", scales_per_tile, "], got ",
              tile_scales.scalar_type(), " ", tile_scales.sizes());
  const at::Tensor xc = x.contiguous(), tc = tiles.contiguous(), sc = tile_scales.contiguous();
  return sc.scalar_type() == at::kHalf ? tiles_gemm<c10::Half>(xc, tc, sc, n) : tiles_gemm<float>(xc, tc, sc, n);
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("q4_tiles_gemm(Tensor x, Tensor tiles, Tensor tile_scales, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("q4_tiles_gemm", &kiln_cpu::q4_tiles_gemm); }
