// x quantized to int8 for the integer ("a8") GEMV kernels (cpu_blocks_a8.cpp: Q8_0 blocks of 32 values,
// cpu_kquants_a8.cpp: Q8_K blocks of 256): per block, d = max|x| / 127 and q = round(x / d), half away
// from zero (C's roundf, ggml's reference quantizers). d stays float32.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace kiln_cpu {

// x for an a8 kernel: float32 [rows, K] (rows < 0: any M) on the CPU, K a multiple of `block` (32 for
// Q8_0 activations, 256 for Q8_K); errors name `op`
inline void check_activation(const char* op, const at::Tensor& x, int64_t rows, int64_t block) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU, got ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && (rows < 0 || x.size(0) == rows), op,
              ": x must be float32 [", rows < 0 ? "M" : "1", ", K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) % block == 0, op, ": K = ", x.size(1), " must be a multiple of ", block);
}

// n floats (a multiple of 32) -> n int8 values `q`; returns the block's d. A NaN or an infinity in the
// block makes d NaN (so the block's outputs become NaN through it) and q zero.
inline float quantize_int8_block(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    const float a = std::fabs(x[j]);
    nan |= !std::isfinite(a);
    amax = a > amax ? a : amax;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j) q[j] = 0;
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
  const __m256 vid = _mm256_set1_ps(id);
  for (int64_t b = 0; b < n; b += 32) {
    __m256i parts[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + b + 8 * i), vid);
      const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      // one more step away from zero where |v - t| >= 1/2
      const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)), half, _CMP_GE_OQ);
      const __m256 step = _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(v, sign), one));
      parts[i] = _mm256_cvtps_epi32(_mm256_add_ps(t, step));
    }
    // int32 -> int8 with the packs' lane interleaving undone
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(parts[0], parts[1]), _mm256_packs_epi32(parts[2], parts[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b), packed);
  }
#else
  for (int64_t j = 0; j < n; ++j) q[j] = static_cast<int8_t>(std::round(x[j] * id));
#endif
  return d;
}

}  // namespace kiln_cpu
