// The sum of a __m256's eight floats, for the AVX2 kernels of the GGUF-block GEMVs and GEMMs
// (cpu_q4_blocks.cpp, cpu_q8_blocks.cpp, cpu_blocks_a8.cpp), in the order all of them use.
#pragma once

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>

namespace kiln_cpu {

inline float hsum(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

}  // namespace kiln_cpu
#endif
