// The one-row kernel of the "q8_blocks_onednn" and "int8_blocks_onednn" layouts
// (kiln.ops.gemm.weight_formats): y = x @ W^T with W kept as int8 values in blocks of B = 32 weights
// (GGUF Q8_0: w = d * q) or B = 16 (GGUF Q6_K's sub-blocks: w = (d * sc) * (q - 32)), one float32
// scale a block, computed in float32 on those exact values:
//
//   y[n] = sum_g d[n, g] * sum_j x[B g + j] * q[n, B g + j]
//
// values int8 [N, K] are the blocks' q in weight order, scales float32 [N, K / B] their scales; B is
// read from the scales' shape. One row of x reads a byte a weight (plus a float a block) instead of the
// two bytes of an fp16 GEMV or the four of a float32 one; the AVX2 build reads four weight rows at a
// time, the AVX-512 one a row at a time, in 8 or 16 float lanes (cpu_float_lanes.h). q8_blocks_gemm
// does a few rows at once (batched decode; its vector kernel converts each block to float32 once for
// up to 8 rows of x). Registered as torch.ops.kiln_cpu.q8_blocks_gemv and q8_blocks_gemm.
//
// Optional mins float32 [N, K / B] (the "q8_blocks_mins_onednn" layout: GGUF Q5_K's w = (d * sc) * q -
// dmin * m with q in 0..31, mins -(dmin * m), B = 32; or a fused projection whose parts mix GGUF types,
// Q4_K beside Q6_K, all as values, a scale and a min per 16: kiln.quant.gguf_blocks.GGUFStackedWeight)
// add each block's min, as the Q4 kernel (cpu_q4_blocks.cpp) does its m:
//
//   y[n] = sum_g d[n, g] * sum_j x[B g + j] * q[n, B g + j]  +  m[n, g] * sum_j x[B g + j]
//
// one row: x's block sums once per call, then a vector dot with each weight row's mins; several rows:
// each block's weights become fma(q, d, m) once for all the rows. Without mins, the floats of before.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_float_lanes.h"
#include "native_cpu_ops.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlocks[] = {32, 16};  // weights per scale: a GGUF Q8_0 block, a Q6_K sub-block
constexpr int64_t kRowsPerTask = 16;
// Software prefetch this far ahead of the block being read, once per 64-byte line (as the Q4 kernel,
// cpu_q4_blocks.cpp: a matrix is too short a stream for the hardware prefetcher to reach full speed)
constexpr int64_t kPrefetchAhead = 4096;

#if defined(KILN_FLOAT_LANES)
using namespace kiln_cpu::lanes;  // Floats: kLanes floats, 16 (AVX-512) or 8 (AVX2)
// Weight rows a one-row GEMV reads at once: 4 on AVX2; on a 2-core Zen 5 with AVX-512 one row reads
// faster (SmolLM2's 49152 x 576 head cache-cold: 0.77 ms, ~37 GB/s, against 0.87-0.99 ms for 4 rows)
constexpr int kGemvRows = kLanes == 16 ? 1 : 4;

// R consecutive weight rows (`k` bytes apart; d and m `groups` apart) against one row of x, in blocks of
// B: each loaded x vector serves R rows, and the R accumulators are independent chains. `stop`: the end
// of the rows this task reads; prefetches stay before it (inside the weights). m (with xsum, x's block
// sums): the rows' mins, or null.
template <int B, int R>
void rows_dot(const float* x, const float* xsum, const int8_t* rows, int64_t k, const float* d, const float* m,
              int64_t groups, const int8_t* stop, float* y) {
  constexpr int kParts = B / kLanes;
  Floats acc[R];
  for (int i = 0; i < R; ++i) acc[i] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    if ((g * B) % 64 == 0) {  // once per 64-byte line
      for (int i = 0; i < R; ++i) {
        const int8_t* ahead = rows + i * k + g * B + kPrefetchAhead;
        if (ahead < stop) _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      }
    }
    const float* xb = x + g * B;
    Floats t[R];
    for (int i = 0; i < R; ++i) t[i] = zero();
    for (int part = 0; part < kParts; ++part) {
      const Floats xp = load(xb + kLanes * part);
      for (int i = 0; i < R; ++i) t[i] = fmadd(int8s(rows + i * k + g * B + kLanes * part), xp, t[i]);
    }
    for (int i = 0; i < R; ++i) acc[i] = fmadd(set1(d[i * groups + g]), t[i], acc[i]);
  }
  for (int i = 0; i < R; ++i) {
    y[i] = m == nullptr ? sum(acc[i]) : sum(acc[i]) + min_terms(m + i * groups, xsum, groups);
  }
}

// R rows of x (`k` apart) against W consecutive weight rows (`k` bytes apart; d and m `groups` apart),
// in blocks of B: each block's weights become float32 once for all R rows, w = d * q, or with Mins
// fma(q, d, m) (d * q is exact in float32, so one rounding of d * q + m: the float32 copy's values, as
// gguf's decode). Every (x row, weight row) pair sums into one accumulator in the same order whatever R
// and W are, so a row's result does not depend on how many rows share the call (batch-invariant); W
// weight rows at once keep R * W >= 6 chains in flight where R is small. y[i * n + j] for x row i and
// weight row j.
template <int B, int R, int W, bool Mins>
void x_rows_dot(const float* x, int64_t k, const int8_t* rows, const float* d, const float* m, int64_t groups,
                const int8_t* stop, float* y, int64_t n) {
  constexpr int kParts = B / kLanes;
  Floats acc[R * W];
  for (int i = 0; i < R * W; ++i) acc[i] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    for (int j = 0; j < W; ++j) {
      const int8_t* q = rows + j * k + g * B;
      if ((g * B) % 64 == 0 && q + kPrefetchAhead < stop) {
        _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchAhead), _MM_HINT_T0);
      }
      const Floats dg = set1(d[j * groups + g]);
      Floats w[kParts];  // weights kLanes part .. kLanes part + kLanes - 1
      if constexpr (Mins) {
        const Floats mg = set1(m[j * groups + g]);
        for (int part = 0; part < kParts; ++part) w[part] = fmadd(int8s(q + kLanes * part), dg, mg);
      } else {
        for (int part = 0; part < kParts; ++part) w[part] = mul(int8s(q + kLanes * part), dg);
      }
      for (int i = 0; i < R; ++i) {
        const float* xb = x + i * k + g * B;
        Floats& a = acc[i * W + j];
        for (int part = 0; part < kParts; ++part) a = fmadd(w[part], load(xb + kLanes * part), a);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < W; ++j) y[i * n + j] = sum(acc[i * W + j]);
  }
}

// x rows [0, rows) (at most kXRows) against weight rows [begin, end): W weight rows at a time, then
// one at a time for the rest (the same sums either way)
template <int B, bool Mins, int R>
void x_rows_times_weight_rows(const float* x, int64_t k, const int8_t* q, const float* d, const float* m,
                              int64_t groups, int64_t begin, int64_t end, const int8_t* stop, float* y, int64_t n) {
  constexpr int W = R >= 5 ? 1 : R >= 3 ? 2 : 8 / R;  // R * W >= 6 independent accumulators
  int64_t row = begin;
  for (; row + W <= end; row += W) {
    x_rows_dot<B, R, W, Mins>(x, k, q + row * k, d + row * groups, Mins ? m + row * groups : nullptr, groups, stop,
                              y + row, n);
  }
  for (; row < end; ++row) {
    x_rows_dot<B, R, 1, Mins>(x, k, q + row * k, d + row * groups, Mins ? m + row * groups : nullptr, groups, stop,
                              y + row, n);
  }
}

using XRowsTimesWeightRows = void (*)(const float*, int64_t, const int8_t*, const float*, const float*, int64_t,
                                      int64_t, int64_t, const int8_t*, float*, int64_t);
// x rows a pass: 8 accumulators (one a pair) and the block's weight vectors stay in registers
constexpr int kXRows = 8;
template <int B, bool Mins, size_t... R>
constexpr std::array<XRowsTimesWeightRows, kXRows + 1> rows_table(std::index_sequence<R...>) {
  return {nullptr, x_rows_times_weight_rows<B, Mins, R + 1>...};
}
// [R]: R x rows, blocks of 32 / 16, without and with mins
constexpr auto kXRowsTimesWeightRows32 = rows_table<32, false>(std::make_index_sequence<kXRows>());
constexpr auto kXRowsTimesWeightRows16 = rows_table<16, false>(std::make_index_sequence<kXRows>());
constexpr auto kXRowsTimesWeightRowsMins32 = rows_table<32, true>(std::make_index_sequence<kXRows>());
constexpr auto kXRowsTimesWeightRowsMins16 = rows_table<16, true>(std::make_index_sequence<kXRows>());

// one row of x against weight rows [begin, end) in blocks of B (m, xsum: the mins and x's block sums, or
// null)
template <int B>
void gemv_rows(const float* x, const float* xsum, const int8_t* q, int64_t k, const float* d, const float* m,
               int64_t groups, int64_t begin, int64_t end, float* y) {
  const int8_t* stop = q + end * k;
  int64_t row = begin;
  for (; row + kGemvRows <= end; row += kGemvRows) {
    rows_dot<B, kGemvRows>(x, xsum, q + row * k, k, d + row * groups, m ? m + row * groups : nullptr, groups, stop,
                           y + row);
  }
  for (; row < end; ++row) {
    rows_dot<B, 1>(x, xsum, q + row * k, k, d + row * groups, m ? m + row * groups : nullptr, groups, stop, y + row);
  }
}
#else
// m, xsum: the row's mins and x's block sums, or null
float row_dot(const float* x, const float* xsum, const int8_t* row, const float* d, const float* m, int64_t groups,
              int64_t block) {
  float s = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    float t = 0.f;
    for (int64_t j = 0; j < block; ++j) t += x[g * block + j] * static_cast<float>(row[g * block + j]);
    s += m == nullptr ? d[g] * t : d[g] * t + m[g] * xsum[g];
  }
  return s;
}
#endif

// The argument checks of both ops; `one_row`: x must be [1, K] (q8_blocks_gemv), else [M, K]. Returns
// the block size B, K / scales.size(1): 32 or 16 (mins, where given, have the scales' shape).
int64_t check_args(const char* op, bool one_row, const at::Tensor& x, const at::Tensor& values,
                   const at::Tensor& scales, const std::optional<at::Tensor>& mins) {
  TORCH_CHECK(x.device().is_cpu() && values.device().is_cpu() && scales.device().is_cpu() &&
                  (!mins.has_value() || mins->device().is_cpu()),
              op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && (!one_row || x.size(0) == 1), op,
              ": x must be float32 ", one_row ? "[1, K]" : "[M, K]", ", got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(values.scalar_type() == at::kChar && values.dim() == 2,
              op, ": values must be int8 [N, K], got ", values.scalar_type(), " ", values.sizes());
  const int64_t n = values.size(0), k = x.size(1);
  TORCH_CHECK(values.size(1) == k, op, ": values must be int8 [N, K] with K = ", k, " (x's), got ", values.sizes());
  TORCH_CHECK(k % 16 == 0, op, ": K = ", k, " must be a multiple of 16 (32 for a scale per 32)");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) > 0 && (scales.size(1) * kBlocks[0] == k || scales.size(1) * kBlocks[1] == k),
              op, ": scales must be float32 [N, K / 32] = [", n, ", ", k / kBlocks[0], "] or [N, K / 16] = [", n,
              ", ", k / kBlocks[1], "], got ", scales.scalar_type(), " ", scales.sizes());
  const int64_t block = k / scales.size(1);
  if (mins.has_value()) {
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->dim() == 2 && mins->size(0) == n &&
                    mins->size(1) == k / block,
                op, ": mins must be float32 [N, K / ", block, "] = [", n, ", ", k / block,
                "] (the scales' shape), got ", mins->scalar_type(), " ", mins->sizes());
  }
  return block;
}

}  // namespace

namespace kiln_cpu {

at::Tensor q8_blocks_gemv(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins) {
  const int64_t block = check_args("q8_blocks_gemv", true, x, values, scales, mins);
  const int64_t n = values.size(0), k = x.size(1), groups = k / block;
  const at::Tensor xc = x.contiguous(), qc = values.contiguous(), dc = scales.contiguous();
  const at::Tensor mc = mins.has_value() ? mins->contiguous() : at::Tensor();
  at::Tensor y = at::empty({1, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.defined() ? mc.data_ptr<float>() : nullptr;
  const std::vector<float> xsum = mp != nullptr ? block_sums(xp, 1, k, block) : std::vector<float>();
  const float* xs = xsum.data();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
#if defined(KILN_FLOAT_LANES)
    if (block == 32) {
      gemv_rows<32>(xp, xs, qp, k, dp, mp, groups, begin, end, yp);
    } else {
      gemv_rows<16>(xp, xs, qp, k, dp, mp, groups, begin, end, yp);
    }
#else
    for (int64_t row = begin; row < end; ++row) {
      yp[row] = row_dot(xp, xs, qp + row * k, dp + row * groups, mp ? mp + row * groups : nullptr, groups, block);
    }
#endif
  });
  return y;
}

// x float32 [M, K] (M >= 1) -> y float32 [M, N], each row as q8_blocks_gemv computes it. A task's 16
// weight rows stay in the cache while each group of up to 8 x rows passes over them: the weights are
// read from memory once, a byte a weight instead of the float32 copy's four.
at::Tensor q8_blocks_gemm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins) {
  const int64_t block = check_args("q8_blocks_gemm", false, x, values, scales, mins);
  const int64_t rows = x.size(0), n = values.size(0), k = x.size(1), groups = k / block;
  const at::Tensor xc = x.contiguous(), qc = values.contiguous(), dc = scales.contiguous();
  const at::Tensor mc = mins.has_value() ? mins->contiguous() : at::Tensor();
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.defined() ? mc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
#if defined(KILN_FLOAT_LANES)
  const auto& table = mp != nullptr ? (block == 32 ? kXRowsTimesWeightRowsMins32 : kXRowsTimesWeightRowsMins16)
                      : block == 32 ? kXRowsTimesWeightRows32
                                    : kXRowsTimesWeightRows16;
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    const int8_t* stop = qp + end * k;
    for (int64_t r = 0; r < rows; r += kXRows) {
      table[std::min<int64_t>(kXRows, rows - r)](xp + r * k, k, qp, dp, mp, groups, begin, end, stop, yp + r * n, n);
    }
  });
#else
  const std::vector<float> xsum = mp != nullptr ? block_sums(xp, rows, k, block) : std::vector<float>();
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xs = mp != nullptr ? xsum.data() + r * groups : nullptr;
      for (int64_t row = begin; row < end; ++row) {
        yp[r * n + row] = row_dot(xp + r * k, xs, qp + row * k, dp + row * groups, mp ? mp + row * groups : nullptr,
                                  groups, block);
      }
    }
  });
#endif
  return y;
}

}  // namespace kiln_cpu

// mins is optional but has no default in the schema: a compiled graph's C++ wrapper (inductor's
// cpp_wrapper, torch 2.13) leaves out an argument that equals its default and then calls the op with
// too few (a crash); callers pass None
TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("q8_blocks_gemv(Tensor x, Tensor values, Tensor scales, Tensor? mins) -> Tensor");
  m.def("q8_blocks_gemm(Tensor x, Tensor values, Tensor scales, Tensor? mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("q8_blocks_gemv", &kiln_cpu::q8_blocks_gemv);
  m.impl("q8_blocks_gemm", &kiln_cpu::q8_blocks_gemm);
}
