// The several-row kernel of the exact K-quant op (cpu_kquants.cpp) for Q6_K on AVX-512 builds: 16 weight
// rows at a time transposed on the fly from the file's bytes (cpu_tile_lanes.h), as the Q4_K tiles
// (cpu_k4_tiles.h). A Q6_K super-block (210 bytes) is ql (128 bytes of low nibbles), qh (64 bytes of
// 2-bit tops), 16 int8 scales and d: in half h, weight 128 h + 32 t + l (t = 0..3, l = 0..31) is
// ql[64 h + 32 (t & 1) + l]'s low (t < 2) or high nibble with bits 2 t, 2 t + 1 of qh[32 h + l] above it,
// scaled by d sc_j, j = 8 h + 2 t + l / 16. Its exact float32 value (q - 32) d sc_j is one
// fma(q, d sc_j, -32 d sc_j): both products are exact (cpu_kquants_decode.h), so the one rounding leaves
// them as they are. Each weight vector (one weight of each of the 16 rows) is decoded once and multiplied
// by one broadcast x value per x row; each output sums weight by weight in one order whatever the number
// of x rows (batch invariant).
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <climits>
#include <cstdint>

#include "cpu_tile_lanes.h"

namespace kiln_cpu {

// Whether rows `row_bytes` apart can run as Q6_K tiles: their scales are gathered with 32-bit offsets
inline bool q6_k_tile_fits(int64_t row_bytes) { return (kTileRows - 1) * row_bytes <= INT32_MAX - 256; }

// Lane i: row kLaneRows[i]'s offset, `row_bytes` apart (q6_k_tile_fits)
inline __m512i tile_row_offsets(int64_t row_bytes) {
  return _mm512_mullo_epi32(_mm512_load_si512(kLaneRows), _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
}

// The 16 rows' scales d sc_j and offsets -32 d sc_j (j = 0..15) of the super-blocks at `block` + the
// row offsets `at` (lanes in kLaneRows order): four gathers of four int8 scales each, one of d (as fast
// as a seventh transposition of the bytes at 176, scales in its dwords 4-7, in a microbenchmark)
inline void q6_k_tile_scales(const uint8_t* block, __m512i at, __m512 (&scale)[16], __m512 (&offset)[16]) {
  const __m512i dword = _mm512_i32gather_epi32(at, block + 206, 1);  // d is its top half
  const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dword, 16)));
  const __m512 minus32 = _mm512_set1_ps(-32.f);
  for (int f = 0; f < 4; ++f) {
    const __m512i sc = _mm512_i32gather_epi32(at, block + 192 + 4 * f, 1);
    for (int b = 0; b < 4; ++b) {
      const __m512i s = _mm512_srai_epi32(_mm512_slli_epi32(sc, 24 - 8 * b), 24);  // int8 scale 4 f + b
      scale[4 * f + b] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(s));
      offset[4 * f + b] = _mm512_mul_ps(minus32, scale[4 * f + b]);
    }
  }
}

// x rows 0 .. R - 1 (K = k) times Q6_K weight rows row0 .. + 15 (`row_bytes` apart, q6_k_tile_fits):
// y[r * n + i], prefetching the tile after next (tile_rows) not past `stop`.
template <int R>
void q6_k_tile(const float* x, int64_t k, const uint8_t* row0, int64_t row_bytes, const uint8_t* stop, float* y,
               int64_t n) {
  constexpr int64_t bytes = 210;  // a Q6_K super-block
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i m63 = _mm512_set1_epi32(63);
  const __m512i at = tile_row_offsets(row_bytes);
  const uint8_t* rows[16];
  for (int64_t s = 0; s < k / 256; ++s) {
    tile_rows(row0, row_bytes, bytes, s, stop, rows);
    __m512 scale[16], offset[16];
    q6_k_tile_scales(rows[0], at, scale, offset);
    const float* xs = x + s * 256;
    for (int h = 0; h < 2; ++h) {
      __m512i ql[2][8], qh[8];  // dword e of ql[64 h + 32 c ..] and of qh[32 h ..], each row
      transpose16x8(rows, 64 * h, ql[0]);
      transpose16x8(rows, 64 * h + 32, ql[1]);
      transpose16x8(rows, 128 + 32 * h, qh);
#pragma GCC unroll 8
      for (int e = 0; e < 8; ++e) {
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          // the 6-bit quants of weights 128 h + 32 t + 4 e + b, byte b = 0..3 of each lane (bits 6-7 not
          // yet cleared): the nibbles where 0x0F0F0F0F has ones, qh's bits 2 t, 2 t + 1 shifted above them
          const __m512i nibbles = t < 2 ? ql[t][e] : _mm512_srli_epi32(ql[t & 1][e], 4);
          const __m512i quants = low_nibbles_over(nibbles, shift_left(qh[e], 4 - 2 * t));
          const int j = 8 * h + 2 * t + e / 4;
#pragma GCC unroll 4
          for (int b = 0; b < 4; ++b) {
            const __m512i q = _mm512_and_si512(_mm512_srli_epi32(quants, 8 * b), m63);
            const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale[j], offset[j]);
            const int weight = 128 * h + 32 * t + 4 * e + b;
            for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(xs[r * k + weight]), acc[r]);
          }
        }
      }
    }
  }
  const __m512i order = _mm512_load_si512(kLaneRows);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, _mm512_permutexvar_ps(order, acc[r]));
}

}  // namespace kiln_cpu
#endif
