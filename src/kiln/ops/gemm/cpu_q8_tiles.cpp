// The tile kernel of the "q8_blocks[_a8]_onednn" layouts (kiln.ops.gemm.weight_formats): y = x @ W^T for
// several rows of x (batched decode, the LM head of every batched step above all: prepared_linear and
// FlatDecode give it the rows of native_cpu.blocks_tiles_rows("q8"), 16 to 32 on AVX-512 builds) on GGUF
// Q8_0's exact values, from a copy of the blocks made at load in 16-row tiles
// (kiln.ops.gemm.cpu_block_tiles.pack_q8):
//
//   tiles int8 [ceil(N / 16), K * 16]: tile t, block g, weight j, row i holds q of row 16 t + i's
//       weight 32 g + j;
//   tile_scales float32 [ceil(N / 16), K / 32 * 16]: d of the 16 rows' block g.
//
// Rows past N (padding) have zero values and scales. As the Q4 tile kernel (cpu_block_tiles.cpp), each
// step loads one weight of 16 rows, w = q * d (exact in float32: 8 by 11 significant bits), and
// multiplies it by one broadcast value of each x row, so an accumulator holds 16 outputs and no
// horizontal sum ends a row. SmolLM2's 49152 x 576 head cache-cold on a 2-core Zen 5, against the row
// kernel (q8_blocks_gemm) in the same process: 12 rows 2.67 vs 2.78 ms, 16 rows 3.13 vs 3.52, 24 rows
// 4.04 vs 4.99, 32 rows 5.20 vs 6.50; 8 rows 2.27 vs 1.83 (slower: too few FMAs per converted weight
// vector; two tiles a pass, or scaling per block, did no better). Software prefetch of the next tile, as
// the Q4 kernel has, measured no faster here.
// Every output is one float32 sum over k in order whatever the number of rows in the call
// (batch-invariant); the scalar build runs the same sums in the same order.
// Registered as torch.ops.kiln_cpu.q8_tiles_gemm.

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

constexpr int64_t kBlock = 32;  // weights per Q8_0 block
constexpr int64_t kTile = 16;   // weight rows per tile
constexpr int64_t kBlockBytes = kBlock * kTile;  // a tile's values per block

#if defined(KILN_FLOAT_LANES)
using namespace kiln_cpu::lanes;  // Floats: kLanes floats, 16 (AVX-512) or 8 (AVX2)
constexpr int kParts = kTile / kLanes;  // vectors a tile row of 16 outputs takes
// x rows a pass of one tile: AVX-512 16 (16 accumulators; one weight vector serves 16 FMAs), AVX2 6
constexpr int kMaxRows = kLanes == 16 ? 16 : 6;

// R rows of x (xs: [K][kMaxRows], the order the steps read them) against one tile: out[r][v].
template <int R>
void pass(const float* xs, const int8_t* tile, const float* scales, int64_t groups, Floats (&out)[kMaxRows][kParts]) {
  Floats acc[R][kParts];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kParts; ++v) acc[r][v] = zero();
  }
  for (int64_t g = 0; g < groups; ++g) {
    Floats d[kParts];
    for (int v = 0; v < kParts; ++v) d[v] = load(scales + g * kTile + v * kLanes);
    const int8_t* tg = tile + g * kBlockBytes;
    const float* xg = xs + g * kBlock * kMaxRows;
    for (int j = 0; j < kBlock; ++j) {
      Floats w[kParts];
      for (int v = 0; v < kParts; ++v) w[v] = mul(int8s(tg + j * kTile + v * kLanes), d[v]);
      const float* xj = xg + j * kMaxRows;
      for (int r = 0; r < R; ++r) {
        const Floats xb = set1(xj[r]);
        for (int v = 0; v < kParts; ++v) acc[r][v] = fmadd(w[v], xb, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kParts; ++v) out[r][v] = acc[r][v];
  }
}

using Pass = void (*)(const float*, const int8_t*, const float*, int64_t, Floats (&)[kMaxRows][kParts]);
template <size_t... R>
constexpr std::array<Pass, kMaxRows + 1> pass_table(std::index_sequence<R...>) {
  return {nullptr, pass<R + 1>...};
}
constexpr auto kPasses = pass_table(std::make_index_sequence<kMaxRows>());  // [R]: R x rows
#endif

}  // namespace

namespace kiln_cpu {

at::Tensor q8_tiles_gemm(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales, int64_t n) {
  const char* op = "q8_tiles_gemm";
  TORCH_CHECK(x.device().is_cpu() && tiles.device().is_cpu() && tile_scales.device().is_cpu(), op,
              ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, op, ": x must be float32 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kBlock, num_tiles = (n + kTile - 1) / kTile;
  const int64_t tile_bytes = k * kTile, scales_per_tile = groups * kTile;
  TORCH_CHECK(k % kBlock == 0 && n > 0, op, ": K = ", k, " must be a multiple of 32 and N = ", n, " positive");
  TORCH_CHECK(tiles.scalar_type() == at::kChar && tiles.dim() == 2 && tiles.size(0) == num_tiles &&
                  tiles.size(1) == tile_bytes,
              op, ": tiles must be int8 [ceil(N / 16), K * 16] = [", num_tiles, ", ", tile_bytes, "] for K = ", k,
              ", N = ", n, ", got ", tiles.scalar_type(), " ", tiles.sizes());
  TORCH_CHECK(tile_scales.scalar_type() == at::kFloat && tile_scales.dim() == 2 &&
                  tile_scales.size(0) == num_tiles && tile_scales.size(1) == scales_per_tile,
              op, ": tile_scales must be float32 [", num_tiles, ", ", scales_per_tile, "], got ",
              tile_scales.scalar_type(), " ", tile_scales.sizes());
  const at::Tensor xc = x.contiguous(), tc = tiles.contiguous(), sc = tile_scales.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* tp = tc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(KILN_FLOAT_LANES)
  // x's rows kMaxRows at a time, each chunk [K][kMaxRows]
  const int64_t chunks = (rows + kMaxRows - 1) / kMaxRows;
  std::vector<float> packed(chunks * k * kMaxRows);
  for (int64_t r = 0; r < rows; ++r) {
    float* chunk = packed.data() + (r / kMaxRows) * k * kMaxRows + r % kMaxRows;
    for (int64_t kk = 0; kk < k; ++kk) chunk[kk * kMaxRows] = xp[r * k + kk];
  }
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    Floats out[kMaxRows][kParts];
    float buffer[kTile];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t width = std::min<int64_t>(kTile, n - t * kTile);
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const int64_t count = std::min<int64_t>(kMaxRows, rows - r);
        kPasses[count](packed.data() + (r / kMaxRows) * k * kMaxRows, tp + t * tile_bytes, sp + t * scales_per_tile,
                       groups, out);
        for (int64_t i = 0; i < count; ++i) {
          float* yr = yp + (r + i) * n + t * kTile;
          if (width == kTile) {
            for (int v = 0; v < kParts; ++v) store(yr + v * kLanes, out[i][v]);
          } else {
            for (int v = 0; v < kParts; ++v) store(buffer + v * kLanes, out[i][v]);
            std::memcpy(yr, buffer, width * sizeof(float));
          }
        }
      }
    }
  });
#else
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int8_t* tile = tp + t * tile_bytes;
      const float* scales = sp + t * scales_per_tile;
      const int64_t width = std::min<int64_t>(kTile, n - t * kTile);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + r * k;
        for (int64_t i = 0; i < width; ++i) {
          float acc = 0.f;
          for (int64_t g = 0; g < groups; ++g) {
            const float d = scales[g * kTile + i];
            for (int64_t j = 0; j < kBlock; ++j) {
              const float w = static_cast<float>(tile[g * kBlockBytes + j * kTile + i]) * d;
              acc = std::fma(w, xr[g * kBlock + j], acc);
            }
          }
          yp[r * n + t * kTile + i] = acc;
        }
      }
    }
  });
#endif
  return y;
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("q8_tiles_gemm(Tensor x, Tensor tiles, Tensor tile_scales, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("q8_tiles_gemm", &kiln_cpu::q8_tiles_gemm); }
