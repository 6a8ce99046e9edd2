// The many-row kernel of the exact GGUF-block layouts ("q4_blocks[_a8]_onednn", "q8_blocks[_a8]_onednn",
// "q8_blocks_mins[_a8]_onednn": kiln.ops.gemm.weight_formats): y = x @ W^T for prefill and large batches,
// on the blocks the layouts keep for their one-row and few-row kernels, so they need no float32 copy of
// the matrix (4 bytes a weight) for these rows:
//
//   Q4  values uint8 [N, K / 2] (cpu_q4_blocks.pack: a block's 16 bytes, weight j in byte j's low nibble,
//       j + 16 in its high one), scales and mins float32 [N, K / 32]:   w = fma(q, d, m)
//   Q8  values int8 [N, K], scales float32 [N, K / B] (B = 32, or 16: Q6_K), optional mins of the same
//       shape (Q5_K, stacked weights):                                  w = q * d  /  fma(q, d, m)
//
// and, as kquants_panel_gemm (kiln.ops.gemm.cpu_kquants), GGUF K-quant blocks as the file stores them
// (Q4_K / Q5_K / Q6_K parts, cpu_kquants_decode.h: the same float32 values by the same fma / product)
//
// each weight rounded once to float32: the float32 copy's values. A thread takes kRows weight rows at a
// time (14 on AVX-512, 6 on AVX2), decodes them once for the whole call into a panel in L1 / L2 (per
// GGUF block of 32: the rows' 32 floats in turn, so every broadcast of the micro-kernel is one base
// pointer and a constant offset), then runs x in chunks of kCols = 2 vectors of rows (32 / 16): x^T
// packed once per call, each chunk [K][kCols], so a step loads two vectors of x and broadcasts each of
// the kRows weights into two FMAs (28 of the 32 AVX-512 registers accumulate). Each output is one
// float32 sum over k in order, fma(w, x, acc) from 0, whatever the call's rows: batch-invariant.
// Registered as torch.ops.kiln_cpu.blocks_panel_gemm and kquants_panel_gemm. Vector builds only replace
// the float32 copy (kiln.ops.native_cpu.blocks_panel_runs()); the scalar build's loop is the same sums,
// for the tests.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_float_lanes.h"
#include "cpu_kquants_decode.h"
#include "native_cpu_ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // weights per GGUF block: the panel's unit along K

// How a weight row's block g becomes 32 floats: the layout's fields for one call
struct Fields {
  const uint8_t* q4 = nullptr;  // Q4 nibbles [N, K / 2], or null
  const int8_t* q8 = nullptr;   // Q8 values [N, K], or null
  const float* scales = nullptr;
  const float* mins = nullptr;  // or null (Q8 without mins)
  int64_t k = 0, per = 32;      // K; weights per scale (32, or 16)

  float weight(int64_t n, int64_t i) const {  // the scalar decode of W[n, i]
    const int64_t s = n * (k / per) + i / per;
    if (q4 != nullptr) {
      const uint8_t b = q4[n * (k / 2) + (i / kBlock) * 16 + (i % 16)];
      const float q = static_cast<float>((i % kBlock) < 16 ? (b & 15) : (b >> 4));
      return std::fma(q, scales[s], mins[s]);
    }
    const float q = static_cast<float>(q8[n * k + i]);
    return mins != nullptr ? std::fma(q, scales[s], mins[s]) : q * scales[s];
  }
};

#if defined(KILN_FLOAT_LANES)
using namespace kiln_cpu::lanes;  // Floats: kLanes floats, 16 (AVX-512) or 8 (AVX2)
constexpr int kCols = 2 * kLanes;             // x rows a micro-tile (the vector side)
constexpr int kRows = kLanes == 16 ? 14 : 6;  // weight rows a micro-tile: 2 * kRows accumulators + 2 of x
constexpr int kPieces = kBlock / kLanes;      // vectors a block of 32 weights takes
constexpr size_t kCachedFloats = size_t{1} << 22;  // 16 MB of x^T kept between calls

// Weight row n's block g as 32 floats at dst (in weight order)
inline void decode_block(const Fields& f, int64_t n, int64_t g, float* dst) {
  if (f.q4 != nullptr) {
    const int64_t s = n * (f.k / kBlock) + g;
    const Floats d = set1(f.scales[s]), m = set1(f.mins[s]);
    const uint8_t* p = f.q4 + n * (f.k / 2) + g * 16;
    for (int part = 0; part < 16 / kLanes; ++part) {  // AVX-512: one; AVX2: two halves of the 16 bytes
      Floats lo, hi;
      nibbles(p + part * kLanes, lo, hi);
      store(dst + part * kLanes, fmadd(lo, d, m));
      store(dst + 16 + part * kLanes, fmadd(hi, d, m));
    }
    return;
  }
  const int8_t* p = f.q8 + n * f.k + g * kBlock;
  for (int v = 0; v < kPieces; ++v) {
    const int64_t s = n * (f.k / f.per) + (g * kBlock + v * kLanes) / f.per;
    const Floats q = int8s(p + v * kLanes), d = set1(f.scales[s]);
    store(dst + v * kLanes, f.mins != nullptr ? fmadd(q, d, set1(f.mins[s])) : mul(q, d));
  }
}

// R weight rows (their panel: block g's row r at panel[(g * kRows + r) * 32]) against one chunk of x^T
// (xt [K][kCols]; V of its vectors, 1 for a last chunk of at most kLanes rows) -> out[r][c] = sum_k
// w[r][k] * x[c][k] for the chunk's rows c
template <int R, int V>
void micro_tile(const float* panel, const float* xt, int64_t groups, float (&out)[kRows][kCols]) {
  Floats acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = zero();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float* pg = panel + g * kRows * kBlock;
    const float* xg = xt + g * kBlock * kCols;
#pragma GCC unroll 8
    for (int j = 0; j < kBlock; ++j) {
      Floats xv[V];
      for (int v = 0; v < V; ++v) xv[v] = load(xg + j * kCols + v * kLanes);
      for (int r = 0; r < R; ++r) {
        const Floats w = set1(pg[r * kBlock + j]);
        for (int v = 0; v < V; ++v) acc[r][v] = fmadd(w, xv[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) store(out[r] + v * kLanes, acc[r][v]);
  }
}

using TileFn = void (*)(const float*, const float*, int64_t, float (&)[kRows][kCols]);

template <int V, int... Rs>
constexpr std::array<TileFn, sizeof...(Rs)> tile_table(std::integer_sequence<int, Rs...>) {
  return {&micro_tile<Rs + 1, V>...};
}
// kTiles[v - 1][r - 1]: the micro-tile of r weight rows and v vectors of x rows
constexpr std::array<std::array<TileFn, kRows>, 2> kTiles = {
    tile_table<1>(std::make_integer_sequence<int, kRows>{}),
    tile_table<2>(std::make_integer_sequence<int, kRows>{}),
};

// y [m, n] = x [m, k] @ W^T, `decode_rows(n0, rows, panel)` writing weight rows n0 .. n0 + rows - 1 into
// the panel (block g of row r at panel[(g * kRows + r) * 32])
template <typename DecodeRows>
void panel_gemm(const float* x, int64_t m, int64_t k, int64_t n, const DecodeRows& decode_rows, float* y) {
  const int64_t groups = k / kBlock, chunks = (m + kCols - 1) / kCols;
  // x^T in chunks of kCols rows, zero past row m: xt[c][kk][i] = x[c * kCols + i][kk]. Up to
  // kCachedFloats in a buffer kept across calls (a fresh one faults its pages in on every call: ~3 % of
  // a SmolLM2-sized call), larger ones fresh.
  thread_local std::vector<float> cached;
  std::vector<float> fresh;
  const size_t xt_size = static_cast<size_t>(chunks) * k * kCols;
  std::vector<float>& buffer = xt_size <= kCachedFloats ? cached : fresh;
  if (buffer.size() < xt_size) buffer.resize(xt_size);
  float* xt = buffer.data();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t rows = std::min<int64_t>(kCols, m - c * kCols);
      float* dst = xt + c * k * kCols;
      for (int64_t k0 = 0; k0 < k; k0 += kBlock) {  // a block of K at a time: its 4 KB of x^T in L1
        float* block = dst + k0 * kCols;
        for (int64_t i = 0; i < kCols; ++i) {
          if (i < rows) {
            const float* src = x + (c * kCols + i) * k + k0;
            for (int64_t kk = 0; kk < kBlock; ++kk) block[kk * kCols + i] = src[kk];
          } else {
            for (int64_t kk = 0; kk < kBlock; ++kk) block[kk * kCols + i] = 0.f;
          }
        }
      }
    }
  });
  const int64_t tiles = (n + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> panel;  // kRows rows of K floats: at most a few hundred KB
    panel.resize(static_cast<size_t>(groups) * kRows * kBlock);
    alignas(64) float out[kRows][kCols];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kRows, rows = std::min<int64_t>(kRows, n - n0);
      decode_rows(n0, rows, panel.data());
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t cols = std::min<int64_t>(kCols, m - c * kCols);
        kTiles[cols > kLanes][rows - 1](panel.data(), xt + c * k * kCols, groups, out);
        for (int64_t i = 0; i < cols; ++i) {
          float* yr = y + (c * kCols + i) * n + n0;
          for (int64_t r = 0; r < rows; ++r) yr[r] = out[r][i];
        }
      }
    }
  });
}
void panel_gemm(const float* x, int64_t m, const Fields& f, int64_t n, float* y) {
  const int64_t groups = f.k / kBlock;
  panel_gemm(x, m, f.k, n, [&](int64_t n0, int64_t rows, float* panel) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t r = 0; r < rows; ++r) decode_block(f, n0 + r, g, panel + (g * kRows + r) * kBlock);
    }
  }, y);
}

// The K-quant rows of `parts` (cpu_kquants_decode.h): each super-block's 256 weights, kLanes a vector
void kquants_panel(const float* x, int64_t m, int64_t k, const kiln_cpu::KQuantParts& parts,
                    const uint8_t* blocks, int64_t n, float* y) {
  const int64_t supers = k / kiln_cpu::kKQuantSuper;
  panel_gemm(x, m, k, n, [&](int64_t n0, int64_t rows, float* panel) {
    kiln_cpu::KQuantUnpacked u;
    int64_t part = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = kiln_cpu::kquant_row(parts, blocks, supers, n0 + r, part);
      const int64_t bytes = kiln_cpu::gguf_block(parts.types[part]).bytes;
      kiln_cpu::with_kquant(parts.types[part], [&](auto t) {
        for (int64_t s = 0; s < supers; ++s) {
          kiln_cpu::unpack<decltype(t)::value>(row + s * bytes, u);
          for (int v = 0; v < kiln_cpu::kKQuantSuper / kLanes; ++v) {
            const int64_t g = s * (kiln_cpu::kKQuantSuper / kBlock) + v * kLanes / kBlock;
            store(panel + (g * kRows + r) * kBlock + v * kLanes % kBlock, kiln_cpu::weights<decltype(t)::value>(u, v));
          }
        }
      });
    }
  }, y);
}
#else
// Scalar builds: the same sums in the same order (the layouts keep their float32 copy there, so only
// the tests call this). `row_weights(row, w)` writes weight row `row`'s K floats to w.
template <typename RowWeights>
void rows_gemm(const float* x, int64_t m, int64_t k, int64_t n, const RowWeights& row_weights, float* y) {
  at::parallel_for(0, n, 1, [&](int64_t n0, int64_t n1) {
    std::vector<float> w(k);
    for (int64_t row = n0; row < n1; ++row) {
      row_weights(row, w.data());
      for (int64_t r = 0; r < m; ++r) {
        float acc = 0.f;
        for (int64_t i = 0; i < k; ++i) acc = std::fma(w[i], x[r * k + i], acc);
        y[r * n + row] = acc;
      }
    }
  });
}

void panel_gemm(const float* x, int64_t m, const Fields& f, int64_t n, float* y) {
  rows_gemm(x, m, f.k, n, [&](int64_t row, float* w) {
    for (int64_t i = 0; i < f.k; ++i) w[i] = f.weight(row, i);
  }, y);
}

void kquants_panel(const float* x, int64_t m, int64_t k, const kiln_cpu::KQuantParts& parts,
                    const uint8_t* blocks, int64_t n, float* y) {
  const int64_t supers = k / kiln_cpu::kKQuantSuper;
  rows_gemm(x, m, k, n, [&](int64_t row, float* w) { kiln_cpu::kquant_row_weights(parts, blocks, supers, row, w); },
            y);
}
#endif

}  // namespace

namespace kiln_cpu {

at::Tensor blocks_panel_gemm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins) {
  const char* op = "blocks_panel_gemm";
  TORCH_CHECK(x.device().is_cpu() && values.device().is_cpu() && scales.device().is_cpu() &&
                  (!mins || mins->device().is_cpu()),
              op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, op, ": x must be float32 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k > 0 && k % kBlock == 0, op, ": K = ", k, " must be a positive multiple of 32");
  const bool q4 = values.scalar_type() == at::kByte;
  TORCH_CHECK((q4 || values.scalar_type() == at::kChar) && values.dim() == 2 && values.size(0) > 0 &&
                  values.size(1) == (q4 ? k / 2 : k),
              op, ": values must be uint8 Q4 nibbles [N, K / 2] or int8 Q8 values [N, K] for K = ", k, ", got ",
              values.scalar_type(), " ", values.sizes());
  const int64_t n = values.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == n &&
                  (scales.size(1) == k / 32 || (!q4 && scales.size(1) == k / 16)),
              op, ": scales must be float32 [N, K / 32]", q4 ? "" : " or [N, K / 16]", " = [", n, ", ", k / 32,
              "], got ", scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK(!q4 || mins.has_value(), op, ": Q4 nibbles need their mins (float32 [N, K / 32])");
  TORCH_CHECK(!mins || (mins->scalar_type() == at::kFloat && mins->sizes() == scales.sizes()), op,
              ": mins must be float32 shaped as the scales ", scales.sizes(), ", got ", mins->scalar_type(), " ",
              mins->sizes());
  const at::Tensor xc = x.contiguous(), vc = values.contiguous(), sc = scales.contiguous();
  const std::optional<at::Tensor> mc = mins ? std::optional<at::Tensor>(mins->contiguous()) : std::nullopt;
  Fields f;
  f.k = k;
  f.per = k / sc.size(1);
  f.scales = sc.data_ptr<float>();
  f.mins = mc ? mc->data_ptr<float>() : nullptr;
  if (q4) {
    f.q4 = vc.data_ptr<uint8_t>();
  } else {
    f.q8 = vc.data_ptr<int8_t>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m > 0) panel_gemm(xc.data_ptr<float>(), m, f, n, y.data_ptr<float>());
  return y;
}

at::Tensor kquants_panel_gemm(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, int64_t n) {
  const KQuantParts table = check_kquant_args("kquants_panel_gemm", x, blocks, parts, n);
  const int64_t m = x.size(0), k = x.size(1);
  const at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) kquants_panel(xc.data_ptr<float>(), m, k, table, bc.data_ptr<uint8_t>(), n, y.data_ptr<float>());
  return y;
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("blocks_panel_gemm(Tensor x, Tensor values, Tensor scales, Tensor? mins) -> Tensor");
  m.def("kquants_panel_gemm(Tensor x, Tensor blocks, Tensor parts, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("blocks_panel_gemm", &kiln_cpu::blocks_panel_gemm);
  m.impl("kquants_panel_gemm", &kiln_cpu::kquants_panel_gemm);
}
