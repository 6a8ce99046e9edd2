// The one-row kernels of the "q4_blocks_a8_onednn" and "q8_blocks_a8_onednn" layouts
// (kiln.ops.gemm.weight_formats): y = x @ W^T with W kept as GGUF blocks of 32 weights (as the exact
// q4_blocks / q8_blocks kernels keep them) and x quantized first, as llama.cpp's CPU backend does,
// to Q8_0 blocks: per 32 values, d = max|x| / 127 and q = round(x / d) (half away from zero) in int8.
// Each block's dot product is then exact integer arithmetic:
//
//   Q4 (w = dw * qw + mw, qw in 0..15):  y[n] = sum_g dw dx sum_j qw qx  +  mw dx sum_j qx
//   Q8_0 (w = dw * qw, qw int8):        y[n] = sum_g dw dx sum_j qw qx
//
// The Q8 kernel also takes the q8_blocks layouts' other forms: a weight scale per 16 (GGUF Q6_K's q - 32
// with d * sc; each block of x against its two halves) and, as q8_blocks_mins_a8_gemv, a min per block
// of 32 or 16 (Q5_K's, a stacked weight's: kiln.quant.gguf_blocks.GGUFStackedWeight), added as
// mw * dx * sum(qx) over the min's block.
//
// so y is W @ x' in float32, x' = dx * qx the quantized x: the only approximation is x's rounding to
// 255 levels a block. AVX2's vpmaddubsw multiplies 32 unsigned by 32 signed bytes into 16 int16 pair
// sums: Q4's values (<= 15) times qx (|qx| <= 127) stay below 3810, and for Q8_0 (|qw| <= 128 after
// moving qw's sign onto qx) below 32512, so no pair saturates. That replaces the exact kernels'
// per-weight int -> float conversion and FMA, which bound them below the memory bandwidth.
//
// dx stays float32 (gguf stores it as float16; the int8 values are the same, computed from the float32
// d, as ggml's reference quantizer does). A NaN or infinity in a block of x makes that block's dx NaN,
// so it reaches every output.
// Registered as torch.ops.kiln_cpu.quantize_q8_0, q4_blocks_a8_gemv, q8_blocks_a8_gemv and
// q8_blocks_mins_a8_gemv.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_float_lanes.h"
#include "cpu_q8_activations.h"
#include "native_cpu_ops.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#define KILN_A8_AVX2 1  // AVX-512 builds run the AVX2 code: 32 bytes a block is one ymm register
#endif

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // weights per GGUF block, values per Q8_0 activation block
constexpr int64_t kRowsPerTask = 16;
// as cpu_q4_blocks.cpp: prefetch this far ahead, once per 64-byte line
constexpr int64_t kPrefetchAhead = 4096;

// One block of 32 floats -> 32 int8 values `q` and the block's d (returned); *qsum = sum of q.
float quantize_block(const float* x, int8_t* q, int32_t* qsum) {
  const float d = kiln_cpu::quantize_int8_block(x, kBlock, q);
  int32_t sum = 0;
  for (int j = 0; j < kBlock; ++j) sum += q[j];
  *qsum = sum;
  return d;
}

// x float32 [K] -> q int8 [K], d float32 [K / 32], and (when s is not null) s[g] = d[g] * sum(q in g)
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s) {
  for (int64_t g = 0; g < k / kBlock; ++g) {
    int32_t qsum = 0;
    d[g] = quantize_block(x + g * kBlock, q + g * kBlock, &qsum);
    // a NaN block: d * 0 keeps the NaN
    if (s != nullptr) s[g] = d[g] * static_cast<float>(qsum);
  }
}

#if defined(KILN_A8_AVX2)
using kiln_cpu::hsum;
#endif

// One Q4 row: `row` the nibbles (byte j: weight j low, weight j + 16 high), dw / mw its d and m.
// `stop`: the end of the rows this task reads; prefetches stay before it.
float q4_row(const int8_t* qx, const float* dx, const float* sx, const uint8_t* row, const float* dw,
             const float* mw, int64_t groups, const uint8_t* stop) {
  float tail = 0.f;  // the m * dx * sum(qx) terms
  for (int64_t g = 0; g < groups; ++g) tail += mw[g] * sx[g];
#if defined(KILN_A8_AVX2)
  const __m128i low = _mm_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* bytes = row + g * 16;
    if ((g & 3) == 0 && bytes + kPrefetchAhead < stop) {
      _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchAhead), _MM_HINT_T0);
    }
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    const __m256i qw = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + g * kBlock));
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, a), ones);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(dw[g] * dx[g]), _mm256_cvtepi32_ps(dot), acc);
  }
  return hsum(acc) + tail;
#else
  (void)stop;
  float s = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    int32_t dot = 0;
    for (int j = 0; j < 16; ++j) {
      dot += (row[g * 16 + j] & 15) * qx[g * kBlock + j] + (row[g * 16 + j] >> 4) * qx[g * kBlock + j + 16];
    }
    s += dw[g] * dx[g] * static_cast<float>(dot);
  }
  return s + tail;
#endif
}

// One Q8 row: `row` its int8 values, dw its d per block of 32 (Q8_0's, Q5_0's) or, with Halves, per 16
// (Q6_K's: each block of 32 of x against the two halves of its weights)
template <bool Halves>
float q8_row(const int8_t* qx, const float* dx, const int8_t* row, const float* dw, int64_t groups,
             const int8_t* stop) {
#if defined(KILN_A8_AVX2)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w = row + g * kBlock;
    if ((g & 1) == 0 && w + kPrefetchAhead < stop) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchAhead), _MM_HINT_T0);
    }
    const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + g * kBlock));
    // |qw| as unsigned bytes, qw's sign moved onto qx (|qx| <= 127, so the flip cannot overflow); int32
    // lanes 0-3 sum bytes 0-15 (a first half's), lanes 4-7 bytes 16-31
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(a, qw)), ones);
    const __m256 scale = Halves ? _mm256_set_m128(_mm_set1_ps(dw[2 * g + 1] * dx[g]), _mm_set1_ps(dw[2 * g] * dx[g]))
                                : _mm256_set1_ps(dw[g] * dx[g]);
    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc);
  }
  return hsum(acc);
#else
  (void)stop;
  constexpr int64_t kScaleBlock = Halves ? kBlock / 2 : kBlock;  // weights per dw
  float s = 0.f;
  for (int64_t b = 0; b < groups * kBlock / kScaleBlock; ++b) {
    int32_t dot = 0;
    for (int64_t j = 0; j < kScaleBlock; ++j) dot += row[b * kScaleBlock + j] * qx[b * kScaleBlock + j];
    s += dw[b] * dx[b * kScaleBlock / kBlock] * static_cast<float>(dot);
  }
  return s;
#endif
}

void check_scales(const char* op, const char* what, const at::Tensor& t, int64_t n, int64_t groups) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == n &&
                  t.size(1) == groups,
              op, ": ", what, " must be float32 [N, K / 32] = [", n, ", ", groups, "] on the CPU, got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

}  // namespace

namespace kiln_cpu {

std::tuple<at::Tensor, at::Tensor> quantize_q8_0(const at::Tensor& x) {
  kiln_cpu::check_activation("quantize_q8_0", x, -1, kBlock);
  const at::Tensor xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = k / kBlock;
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, groups}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, k, qp + r * k, dp + r * groups, nullptr);
  });
  return {q, d};
}

at::Tensor q4_blocks_a8_gemv(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                             const at::Tensor& mins) {
  const char* op = "q4_blocks_a8_gemv";
  kiln_cpu::check_activation(op, x, 1, kBlock);
  TORCH_CHECK(nibbles.device().is_cpu() && nibbles.scalar_type() == at::kByte && nibbles.dim() == 2 &&
                  nibbles.size(1) * 2 == x.size(1),
              op, ": nibbles must be uint8 [N, K / 2] on the CPU with K = ", x.size(1), ", got ",
              nibbles.scalar_type(), " ", nibbles.sizes(), " on ", nibbles.device());
  const int64_t n = nibbles.size(0), k = x.size(1), groups = k / kBlock;
  check_scales(op, "scales", scales, n, groups);
  check_scales(op, "mins", mins, n, groups);
  const at::Tensor xc = x.contiguous(), qc = nibbles.contiguous(), dc = scales.contiguous(), mc = mins.contiguous();
  std::vector<int8_t> qx(k);
  std::vector<float> dx(groups), sx(groups);
  quantize_row(xc.data_ptr<float>(), k, qx.data(), dx.data(), sx.data());
  at::Tensor y = at::empty({1, n}, x.options());
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      yp[r] = q4_row(qx.data(), dx.data(), sx.data(), qp + r * (k / 2), dp + r * groups, mp + r * groups, groups,
                     qp + end * (k / 2));
    }
  });
  return y;
}

// q8_blocks_a8_gemv and q8_blocks_mins_a8_gemv: scales (and mins) float32 [N, K / 32] or [N, K / 16]
at::Tensor q8_a8(const char* op, const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                 const at::Tensor* mins) {
  kiln_cpu::check_activation(op, x, 1, kBlock);
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == at::kChar && values.dim() == 2 &&
                  values.size(1) == x.size(1),
              op, ": values must be int8 [N, K] on the CPU with K = ", x.size(1), ", got ", values.scalar_type(),
              " ", values.sizes(), " on ", values.device());
  const int64_t n = values.size(0), k = x.size(1), groups = k / kBlock;
  const bool halves = scales.dim() == 2 && scales.size(1) == 2 * groups;  // a scale per 16
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat && scales.dim() == 2 &&
                  scales.size(0) == n && (scales.size(1) == groups || halves),
              op, ": scales must be float32 [N, K / 32] = [", n, ", ", groups, "] or [N, K / 16] = [", n, ", ",
              2 * groups, "] on the CPU, got ", scales.scalar_type(), " ", scales.sizes(), " on ", scales.device());
  if (mins != nullptr) {
    TORCH_CHECK(mins->device().is_cpu() && mins->scalar_type() == at::kFloat && mins->sizes() == scales.sizes(), op,
                ": mins must be float32 ", scales.sizes(), " (the scales' shape) on the CPU, got ",
                mins->scalar_type(), " ", mins->sizes(), " on ", mins->device());
  }
  const at::Tensor xc = x.contiguous(), qc = values.contiguous(), dc = scales.contiguous();
  const at::Tensor mc = mins != nullptr ? mins->contiguous() : at::Tensor();
  std::vector<int8_t> qx(k);
  std::vector<float> dx(groups), sx(groups);
  quantize_row(xc.data_ptr<float>(), k, qx.data(), dx.data(), sx.data());
  std::vector<float> sx16;  // per 16: dx * sum(qx) over each half block, for mins per 16
  if (mins != nullptr && halves) {
    sx16.resize(2 * groups);
    for (int64_t h = 0; h < 2 * groups; ++h) {
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock / 2; ++j) sum += qx[h * 16 + j];
      sx16[h] = dx[h / 2] * static_cast<float>(sum);
    }
  }
  const float* sums = halves ? sx16.data() : sx.data();
  const int64_t per_row = halves ? 2 * groups : groups;
  at::Tensor y = at::empty({1, n}, x.options());
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* dp = dc.data_ptr<float>();
  const float* mp = mins != nullptr ? mc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* dw = dp + r * per_row;
      float v = halves ? q8_row<true>(qx.data(), dx.data(), qp + r * k, dw, groups, qp + end * k)
                       : q8_row<false>(qx.data(), dx.data(), qp + r * k, dw, groups, qp + end * k);
      if (mp != nullptr) {  // the mins times x' summed over their blocks
        const float* mw = mp + r * per_row;
        float tail = 0.f;
        for (int64_t g = 0; g < per_row; ++g) tail += mw[g] * sums[g];
        v += tail;
      }
      yp[r] = v;
    }
  });
  return y;
}

at::Tensor q8_blocks_a8_gemv(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales) {
  return q8_a8("q8_blocks_a8_gemv", x, values, scales, nullptr);
}

at::Tensor q8_blocks_mins_a8_gemv(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                                  const at::Tensor& mins) {
  return q8_a8("q8_blocks_mins_a8_gemv", x, values, scales, &mins);
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("quantize_q8_0(Tensor x) -> (Tensor, Tensor)");
  m.def("q4_blocks_a8_gemv(Tensor x, Tensor nibbles, Tensor scales, Tensor mins) -> Tensor");
  m.def("q8_blocks_a8_gemv(Tensor x, Tensor values, Tensor scales) -> Tensor");
  m.def("q8_blocks_mins_a8_gemv(Tensor x, Tensor values, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("quantize_q8_0", &kiln_cpu::quantize_q8_0);
  m.impl("q4_blocks_a8_gemv", &kiln_cpu::q4_blocks_a8_gemv);
  m.impl("q8_blocks_a8_gemv", &kiln_cpu::q8_blocks_a8_gemv);
  m.impl("q8_blocks_mins_a8_gemv", &kiln_cpu::q8_blocks_mins_a8_gemv);
}
