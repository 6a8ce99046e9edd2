// Sixteen weight rows side by side, for the exact K-quant tiles (cpu_k4_tiles.h, cpu_q6_k_tiles.h): the
// transposition they make of a super-block's bytes on the fly, so that a vector holds one dword of each
// row, the rows' pointers and prefetch a tile makes each super-block, and the bit steps that join a
// quant's nibble and its top bits.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <cstdint>

namespace kiln_cpu {

constexpr int kTileRows = 16;
// Lane i of a transposed vector holds row kLaneRows[i] (its own inverse: permuting by it restores order)
alignas(64) constexpr int32_t kLaneRows[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

// Dwords 0..7 at byte `at` of rows[0..15] -> v[e]: dword e of each row, lanes in kLaneRows order
inline void transpose16x8(const uint8_t* const (&rows)[16], int at, __m512i (&v)[8]) {
  __m512i z[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) {  // z[i]: row i's 8 dwords, then row i + 8's
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + at));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i + 8] + at));
    z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  }
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  // u[4 g + e], 128-bit lane q: dword 4 (q % 2) + e of rows 4 g .. 4 g + 3 (q < 2) or of those + 8
  for (int g = 0; g < 2; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    v[e] = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88);      // lanes 0 and 2 of each: dword e
    v[4 + e] = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);  // lanes 1 and 3: dword 4 + e
  }
}

// Super-block s (`bytes` long) of rows row0 .. + 15 (`row_bytes` apart) -> rows[0..15]; and a share of the
// tile after next (rows row0 + 32 ..: 16 super-blocks' bytes, read ahead as this tile reads its 16)
// prefetched into L2, not past `stop`. 16 rows read side by side are more streams than the hardware
// prefetcher follows (cache-cold, 8 x rows, Llama-3.2-1B-shaped Q4_K linears on a 2-core Zen 4: 34.4 ms
// without, 33.3 with the next tile into L1, 28.9 with the tile after next into L2).
inline void tile_rows(const uint8_t* row0, int64_t row_bytes, int64_t bytes, int64_t s, const uint8_t* stop,
                      const uint8_t* (&rows)[16]) {
  for (int i = 0; i < 16; ++i) rows[i] = row0 + i * row_bytes + s * bytes;
  const uint8_t* ahead = row0 + 32 * row_bytes + s * 16 * bytes;
  for (const uint8_t* p = ahead; p < ahead + 16 * bytes && p < stop; p += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  }
}

// Bits 0-3 of each byte from `nibbles`, bits 4 and up from `tops` (a ? b : c, bit by bit)
inline __m512i low_nibbles_over(__m512i nibbles, __m512i tops) {
  return _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x0F0F0F0F), nibbles, tops, 0xCA);
}

// v shifted left by `bits` (right where negative)
inline __m512i shift_left(__m512i v, int bits) {
  return bits >= 0 ? _mm512_slli_epi32(v, bits) : _mm512_srli_epi32(v, -bits);
}

}  // namespace kiln_cpu
#endif
