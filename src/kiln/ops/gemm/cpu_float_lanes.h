// Float32 vectors of the build's ISA for the GGUF-block kernels (cpu_q4_blocks.cpp, cpu_q8_blocks.cpp,
// cpu_blocks_a8.cpp), so that each kernel is written once: `Floats` holds kLanes = 16 floats on
// AVX-512 builds, 8 on AVX2 ones (KILN_FLOAT_LANES is defined for either; other builds keep the
// kernels' scalar loops). hsum: a __m256's sum, in the order all the AVX2 code uses. load() also widens
// kLanes float16 values (c10::Half) to float32, exactly. block_sums (every build): the x side of the
// blocks' min terms.
#pragma once

#include <cstdint>
#include <vector>

namespace kiln_cpu {

// the sum of each block of `block` values (32, or 16 for Q6_K-shaped scales) of each of `rows` rows of
// x [rows, k]: [rows, k / block]
inline std::vector<float> block_sums(const float* x, int64_t rows, int64_t k, int64_t block = 32) {
  std::vector<float> sums(rows * (k / block));
  for (size_t b = 0; b < sums.size(); ++b) {
    float s = 0.f;
    for (int64_t j = 0; j < block; ++j) s += x[b * block + j];
    sums[b] = s;
  }
  return sums;
}

}  // namespace kiln_cpu

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

#define KILN_FLOAT_LANES 1

namespace kiln_cpu {

inline float hsum(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

namespace lanes {

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kLanes = 16;
using Floats = __m512;
inline Floats zero() { return _mm512_setzero_ps(); }
inline Floats set1(float v) { return _mm512_set1_ps(v); }
inline Floats load(const float* p) { return _mm512_loadu_ps(p); }
inline Floats load(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store(float* p, Floats v) { _mm512_storeu_ps(p, v); }
inline Floats add(Floats a, Floats b) { return _mm512_add_ps(a, b); }
inline Floats mul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(Floats v) { return _mm512_reduce_add_ps(v); }
// kLanes bytes from p: their low nibbles (lo) and high nibbles (hi) as floats
inline void nibbles(const uint8_t* p, Floats& lo, Floats& hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
}
// kLanes int8 values from p as floats
inline Floats int8s(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
constexpr int kLanes = 8;
using Floats = __m256;
inline Floats zero() { return _mm256_setzero_ps(); }
inline Floats set1(float v) { return _mm256_set1_ps(v); }
inline Floats load(const float* p) { return _mm256_loadu_ps(p); }
inline Floats load(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store(float* p, Floats v) { _mm256_storeu_ps(p, v); }
inline Floats add(Floats a, Floats b) { return _mm256_add_ps(a, b); }
inline Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum(Floats v) { return hsum(v); }
inline void nibbles(const uint8_t* p, Floats& lo, Floats& hi) {
  const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
}
inline Floats int8s(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// The blocks' min terms of one weight row: sum_g m[g] * xsum[g] (xsum: x's sum over each block),
// kLanes groups a step (the Q4 kernels' m, Q5_K's mins in the Q8 ones)
inline float min_terms(const float* m, const float* xsum, int64_t groups) {
  Floats acc = zero();
  int64_t g = 0;
  for (; g + kLanes <= groups; g += kLanes) acc = fmadd(load(m + g), load(xsum + g), acc);
  float s = sum(acc);
  for (; g < groups; ++g) s += m[g] * xsum[g];
  return s;
}

}  // namespace lanes
}  // namespace kiln_cpu
#endif
