// What the a8 K-quant kernels share (cpu_kquants_a8.cpp: the vector row kernels; cpu_kquants_a8_amx.cpp:
// the AMX tile kernel): x in Q8_K form, and the one float32 step that adds a super-block's exact integer
// dot product to an output. Every kernel adds a row's super-blocks so, one after another in K order,
// whatever its vector width or the rows beside it, so an output is the same float32 whichever kernel,
// batch or build computes it.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace kiln_cpu {

// acc += scale * float32(isum), rounded once; scale is d dx (or dmin dx), already rounded to float32
inline void add_super_block(float scale, int32_t isum, float& acc) {
  acc = std::fma(scale, static_cast<float>(isum), acc);
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
inline int32_t hsum_epi32(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
  return _mm_cvtsi128_si32(v);
}

inline int32_t hsum_epi32(__m256i v) {
  return hsum_epi32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
#endif

// x [M, K] in Q8_K form, rows one after another: int8 values [M, K], d [M, K / 256] and the values'
// sums per 32 [M, K / 32]
struct Q8KRows {
  const int8_t* q;
  const float* d;
  const int16_t* sums32;
  int64_t m, k;
};

// The AMX kernel (cpu_kquants_a8_amx.cpp): usable where the build has it and the CPU AMX-INT8 tiles
bool kquants_a8_amx_usable();

// x rearranged for the AMX kernel once per call, in blocks of 16 rows (the last one padded with zero rows):
// `vnni` int8 [blocks, K / 4, 16, 4]: four consecutive values of each row in one 32-bit lane, the layout
// of a tile the int8 dot products read as their second operand; per block and super-block, `d` float32
// [16], and the sums per 32 in int16 pairs, `sums32` int32 [4, 16] (pair p: sums 2p and 2p + 1)
struct Q8KTiles {
  int64_t m, k, blocks, supers;
  std::vector<int8_t> vnni;
  std::vector<float> d;
  std::vector<int32_t> sums32;
  explicit Q8KTiles(const Q8KRows& x);
};

// y[:, n0 .. n0 + 15] (y float32 [M, n]) = x times 16 weight rows of GGML type `type` (Q4_K, Q5_K or
// Q6_K), the first at `rows`, each `row_bytes` long: the outputs kquants_a8_gemv gives, bit for bit. Only
// where kquants_a8_amx_usable().
void kquants_a8_amx_rows(const Q8KTiles& x, int64_t type, const uint8_t* rows, int64_t row_bytes, float* y,
                         int64_t n, int64_t n0);

}  // namespace kiln_cpu
