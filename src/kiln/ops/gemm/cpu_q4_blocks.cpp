// The one-row kernel of the "q4_blocks_onednn" layout (kiln.ops.gemm.weight_formats):
// y = x @ W^T with W kept as GGUF Q4_0 / Q4_1 blocks of 32 weights, w = d * q + m (q in 0..15),
// computed in float32 on those exact values:
//
//   y[n] = sum_g d[n, g] * sum_j x[32 g + j] * q[n, g, j]  +  m[n, g] * sum_j x[32 g + j]
//
// nibbles uint8 [N, K / 2] hold each block's 16 bytes as in the file: byte j's low nibble is weight j,
// its high nibble weight j + 16. One row of x reads half a byte a weight (plus two floats a block)
// instead of the two bytes of an fp16 GEMV; the block sums of x are computed once per call. The AVX2
// build reads four weight rows at a time, the AVX-512 one a row at a time (rows_dot), in 8 or 16 float
// lanes (cpu_float_lanes.h); other builds a scalar loop.
// Registered as torch.ops.kiln_cpu.q4_blocks_gemv.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_float_lanes.h"
#include "native_cpu_ops.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // weights per GGUF Q4 block
constexpr int64_t kRowsPerTask = 16;
// Software prefetch this many bytes ahead of the blocks being read, once per 64-byte line: SmolLM2's
// matrices are 0.3-1.7 MB each, too short a stream for the hardware prefetcher to reach full speed
// (cache-cold, its 120 decoder GEMVs on 2 cores: 8.2 ms without, 5.8 ms with 4 KiB ahead).
constexpr int64_t kPrefetchAhead = 4096;

#if defined(KILN_FLOAT_LANES)
using namespace kiln_cpu::lanes;  // Floats: kLanes floats, 16 (AVX-512) or 8 (AVX2)
constexpr int kParts = 16 / kLanes;  // a block's 16 bytes, kLanes bytes a part
// Weight rows a one-row GEMV reads at once: 4 on AVX2 (above); on a 2-core Zen 5 with AVX-512 one row
// already reads at the memory bandwidth (SmolLM2's 120 decoder GEMVs cache-cold: 2.9 ms, ~28 GB/s;
// 2 rows the same, 4 rows 3.1-3.5 ms)
constexpr int kGemvRows = kLanes == 16 ? 1 : 4;

// R consecutive rows at once (rows r .. r + R - 1, `row_bytes` apart; d and m `groups` apart): each
// loaded x vector serves R rows, and the R accumulators are independent chains. With one row a
// block's scaled add waits on the previous block's (FMA latency), and the m * sum(x) terms were a
// scalar chain too: 1.2-1.3x slower on a Zen 3 (SmolLM2's shapes, cache-cold, 2 cores). Part p of a
// block's bytes holds weights kLanes p .. (low nibbles) and 16 + kLanes p .. (high nibbles).
template <int R>
void rows_dot(const float* x, const float* xsum, const uint8_t* rows, int64_t row_bytes, const float* d, const float* m,
              int64_t groups, const uint8_t* stop, float* y) {
  Floats acc[R];
  for (int i = 0; i < R; ++i) acc[i] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    if ((g & 3) == 0) {
      for (int i = 0; i < R; ++i) {
        const uint8_t* ahead = rows + i * row_bytes + g * 16 + kPrefetchAhead;
        if (ahead < stop) _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      }
    }
    const float* xb = x + g * kBlock;
    Floats t[R];
    for (int i = 0; i < R; ++i) t[i] = zero();
    for (int part = 0; part < kParts; ++part) {
      const Floats xlo = load(xb + kLanes * part), xhi = load(xb + 16 + kLanes * part);
      for (int i = 0; i < R; ++i) {
        Floats lo, hi;
        nibbles(rows + i * row_bytes + g * 16 + kLanes * part, lo, hi);
        t[i] = fmadd(lo, xlo, t[i]);
        t[i] = fmadd(hi, xhi, t[i]);
      }
    }
    for (int i = 0; i < R; ++i) acc[i] = fmadd(set1(d[i * groups + g]), t[i], acc[i]);
  }
  for (int i = 0; i < R; ++i) y[i] = sum(acc[i]) + min_terms(m + i * groups, xsum, groups);
}

// R rows of x (`k` apart) against W consecutive weight rows (`row_bytes` apart; d and m `groups` apart):
// each block's weights become float32 once for all R rows, w = fma(d, q, m), the float32 copy's values
// (one rounding of d * q + m, as gguf's). Every (x row, weight row) pair sums into one accumulator in
// the same order whatever R and W are, so a row's result does not depend on how many rows share the
// call (batch-invariant); W weight rows at once keep R * W >= 6 chains in flight where R is small.
// y[i * n + j] for x row i and weight row j.
template <int R, int W>
void x_rows_dot(const float* x, int64_t k, const uint8_t* rows, int64_t row_bytes, const float* d, const float* m,
                int64_t groups, const uint8_t* stop, float* y, int64_t n) {
  Floats acc[R * W];
  for (int i = 0; i < R * W; ++i) acc[i] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    if ((g & 3) == 0) {
      for (int j = 0; j < W; ++j) {
        const uint8_t* ahead = rows + j * row_bytes + g * 16 + kPrefetchAhead;
        if (ahead < stop) _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      }
    }
    for (int j = 0; j < W; ++j) {
      const uint8_t* bytes = rows + j * row_bytes + g * 16;
      const Floats dg = set1(d[j * groups + g]), mg = set1(m[j * groups + g]);
      Floats w[2 * kParts];  // w[c]: weights kLanes c .. kLanes c + kLanes - 1 of the block
      for (int part = 0; part < kParts; ++part) {
        Floats lo, hi;
        nibbles(bytes + kLanes * part, lo, hi);
        w[part] = fmadd(lo, dg, mg);
        w[kParts + part] = fmadd(hi, dg, mg);
      }
      for (int i = 0; i < R; ++i) {
        const float* xb = x + i * k + g * kBlock;
        Floats& a = acc[i * W + j];
        for (int c = 0; c < 2 * kParts; ++c) a = fmadd(w[c], load(xb + kLanes * c), a);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < W; ++j) y[i * n + j] = sum(acc[i * W + j]);
  }
}

// x rows [0, rows) (at most kXRows) against weight rows [begin, end): W weight rows at a time, then
// one at a time for the rest (the same sums either way)
template <int R>
void x_rows_times_weight_rows(const float* x, int64_t k, const uint8_t* q, int64_t row_bytes, const float* d,
                              const float* m, int64_t groups, int64_t begin, int64_t end, const uint8_t* stop, float* y,
                              int64_t n) {
  constexpr int W = R >= 5 ? 1 : R >= 3 ? 2 : 8 / R;  // R * W >= 6 independent accumulators
  int64_t row = begin;
  for (; row + W <= end; row += W) {
    x_rows_dot<R, W>(x, k, q + row * row_bytes, row_bytes, d + row * groups, m + row * groups, groups, stop, y + row,
                     n);
  }
  for (; row < end; ++row) {
    x_rows_dot<R, 1>(x, k, q + row * row_bytes, row_bytes, d + row * groups, m + row * groups, groups, stop, y + row,
                     n);
  }
}

using XRowsTimesWeightRows = void (*)(const float*, int64_t, const uint8_t*, int64_t, const float*, const float*,
                                      int64_t, int64_t, int64_t, const uint8_t*, float*, int64_t);
// x rows a pass: 8 accumulators (one a pair) and a weight vector stay in registers
constexpr int kXRows = 8;
template <size_t... R>
constexpr std::array<XRowsTimesWeightRows, kXRows + 1> rows_table(std::index_sequence<R...>) {
  return {nullptr, x_rows_times_weight_rows<R + 1>...};
}
constexpr auto kXRowsTimesWeightRows = rows_table(std::make_index_sequence<kXRows>());  // [R]: R x rows
#else
// sum_j x[j] * q[j] over one block, q the 32 nibbles of `bytes` (low nibbles weights 0..15)
inline float block_dot_scalar(const float* x, const uint8_t* bytes) {
  float s = 0.f;
  for (int j = 0; j < 16; ++j) {
    s += x[j] * static_cast<float>(bytes[j] & 15) + x[j + 16] * static_cast<float>(bytes[j] >> 4);
  }
  return s;
}

float row_dot(const float* x, const float* xsum, const uint8_t* row, const float* d, const float* m, int64_t groups) {
  float s = 0.f;
  for (int64_t g = 0; g < groups; ++g) s += d[g] * block_dot_scalar(x + g * kBlock, row + g * 16) + m[g] * xsum[g];
  return s;
}
#endif

// The argument checks of both ops; `one_row`: x must be [1, K] (q4_blocks_gemv), else [M, K]
void check_args(const char* op, bool one_row, const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                const at::Tensor& mins) {
  TORCH_CHECK(x.device().is_cpu() && nibbles.device().is_cpu() && scales.device().is_cpu() && mins.device().is_cpu(),
              op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && (!one_row || x.size(0) == 1), op,
              ": x must be float32 ", one_row ? "[1, K]" : "[M, K]", ", got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 2,
              op, ": nibbles must be uint8 [N, K / 2], got ", nibbles.scalar_type(), " ", nibbles.sizes());
  const int64_t n = nibbles.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0 && nibbles.size(1) * 2 == k,
              op, ": K = ", k, " must be a multiple of 32 with nibbles [N, K / 2], got ", nibbles.sizes());
  const int64_t groups = k / kBlock;
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == n && t->size(1) == groups,
                op, ": scales and mins must be float32 [N, K / 32] = [", n, ", ", groups, "], got ",
                t->scalar_type(), " ", t->sizes());
  }
}

}  // namespace

namespace kiln_cpu {

at::Tensor q4_blocks_gemv(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                          const at::Tensor& mins) {
  check_args("q4_blocks_gemv", true, x, nibbles, scales, mins);
  const int64_t n = nibbles.size(0), k = x.size(1), groups = k / kBlock;
  const at::Tensor xc = x.contiguous(), qc = nibbles.contiguous(), dc = scales.contiguous(), mc = mins.contiguous();
  at::Tensor y = at::empty({1, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const std::vector<float> xsum = block_sums(xp, 1, k);
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = k / 2;
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    const uint8_t* stop = qp + end * row_bytes;
    int64_t row = begin;
#if defined(KILN_FLOAT_LANES)
    const float* xs = xsum.data();
    for (; row + kGemvRows <= end; row += kGemvRows) {
      rows_dot<kGemvRows>(xp, xs, qp + row * row_bytes, row_bytes, dp + row * groups, mp + row * groups, groups,
                          stop, yp + row);
    }
    for (; row < end; ++row) {
      rows_dot<1>(xp, xs, qp + row * row_bytes, row_bytes, dp + row * groups, mp + row * groups, groups, stop,
                  yp + row);
    }
#else
    (void)stop;
    for (; row < end; ++row) {
      yp[row] = row_dot(xp, xsum.data(), qp + row * row_bytes, dp + row * groups, mp + row * groups, groups);
    }
#endif
  });
  return y;
}


// x float32 [M, K] (M >= 1) -> y float32 [M, N]: the rows of q4_blocks_gemv for several rows of x at
// once. A task's weight rows (16 of them, at most 16 KB for K <= 2048) stay in the L1/L2 cache while
// every group of up to 8 x rows passes over them, so the weights are read from memory once, and on
// AVX2 and AVX-512 each block is converted to float32 once for all the rows of a group (x_rows_dot). For batched
// decode: a few rows read 0.75 bytes a weight instead of the float32 copy's 4.
at::Tensor q4_blocks_gemm(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                          const at::Tensor& mins) {
  check_args("q4_blocks_gemm", false, x, nibbles, scales, mins);
  const int64_t rows = x.size(0), n = nibbles.size(0), k = x.size(1), groups = k / kBlock;
  const at::Tensor xc = x.contiguous(), qc = nibbles.contiguous(), dc = scales.contiguous(), mc = mins.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = k / 2;
#if defined(KILN_FLOAT_LANES)
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    const uint8_t* stop = qp + end * row_bytes;
    for (int64_t r = 0; r < rows; r += kXRows) {
      kXRowsTimesWeightRows[std::min<int64_t>(kXRows, rows - r)](xp + r * k, k, qp, row_bytes, dp, mp, groups, begin,
                                                                  end, stop, yp + r * n, n);
    }
  });
#else
  const std::vector<float> xsum = block_sums(xp, rows, k);
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t row = begin; row < end; ++row) {
        yp[r * n + row] = row_dot(xp + r * k, xsum.data() + r * groups, qp + row * row_bytes, dp + row * groups,
                                  mp + row * groups, groups);
      }
    }
  });
#endif
  return y;
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("q4_blocks_gemv(Tensor x, Tensor nibbles, Tensor scales, Tensor mins) -> Tensor");
  m.def("q4_blocks_gemm(Tensor x, Tensor nibbles, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("q4_blocks_gemv", &kiln_cpu::q4_blocks_gemv);
  m.impl("q4_blocks_gemm", &kiln_cpu::q4_blocks_gemm);
}
