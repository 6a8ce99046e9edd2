// The several-row kernel of the exact K-quant op (cpu_kquants.cpp) for Q4_K and Q5_K on AVX-512 builds:
// 16 weight rows at a time, their super-blocks transposed on the fly from the file's bytes so that a
// vector holds one weight of each of the 16 rows, as the "q4_blocks" layout's tiles (cpu_block_tiles.cpp)
// hold them after a copy made at load. Each weight vector is decoded once, w = fma(q, d sc_j, -(dmin m_j))
// (exact, cpu_kquants_decode.h), and multiplied by one broadcast value of each x row: an accumulator
// holds 16 outputs, no horizontal sum ends a row, and x is read a float at a time (the row-vectorized
// kernel reads a vector of each x row per weight row). Warm, one Zen 4 thread, a 2048 x 2048 Q4_K matrix:
// 8 rows 0.75 ms, 12 rows 1.16 (the "q4_blocks" tiles on their load-time copy: 0.76, 1.23; in a
// standalone microbenchmark the row-vectorized kernel with 4 weight rows at once took 0.89, 1.29).
//
// Transposition (cpu_tile_lanes.h): each 32-byte chunk of nibbles is 16 rows x 8 dwords, turned into
// 8 vectors of one dword of each row. Byte b of dword e of chunk c holds weight 4 e + b of sub-block 2 c
// (low nibble) and of 2 c + 1 (high nibble); Q5_K's fifth bits are bits 2 c and 2 c + 1 of byte b of dword
// e of its 32 qh bytes (bytes 16-47, from the transpositions of bytes 0-31 and 32-63). The 16-byte head
// (d, dmin, the 12 scale bytes) comes with the transposition of the first 32 bytes; the scale decode runs
// on the head's vectors, 16 rows at once.
// Each output sums weight by weight, the same order whatever the number of x rows (batch invariant).
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <cstdint>

#include "cpu_tile_lanes.h"

namespace kiln_cpu {

// The 16 rows' scales d sc_j and offsets -(dmin m_j) of sub-blocks j = 0..7 from their transposed heads
// (head[0]: d and dmin; head[1..3]: scale bytes 0-3, 4-7, 8-11), as ggml's get_scale_min_k4 (Q4_K, Q5_K)
inline void k4_tile_scales(const __m512i* head, __m512 (&scale)[8], __m512 (&offset)[8]) {
  const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(48);
  const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head[0]));
  const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head[0], 16)));
  const __m512 negative = _mm512_set1_ps(-0.f);
  for (int j = 0; j < 4; ++j) {
    const __m512i sc = _mm512_and_si512(_mm512_srli_epi32(head[1], 8 * j), m63);
    const __m512i mn = _mm512_and_si512(_mm512_srli_epi32(head[2], 8 * j), m63);
    // sub-blocks 4 + j: the low four bits from bytes 8-11, the top two from the top bits of bytes 0-7
    const __m512i sc4 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(head[3], 8 * j), m15),
                                        _mm512_and_si512(_mm512_srli_epi32(head[1], 8 * j + 2), m48));
    const __m512i mn4 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(head[3], 8 * j + 4), m15),
                                        _mm512_and_si512(_mm512_srli_epi32(head[2], 8 * j + 2), m48));
    scale[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    offset[j] = _mm512_xor_ps(negative, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
    scale[4 + j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc4));
    offset[4 + j] = _mm512_xor_ps(negative, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn4)));
  }
}

// x rows 0 .. R - 1 (K = k) times Q4_K (High false) or Q5_K (High true) weight rows
// row0 .. + 15 (`row_bytes` apart): y[r * n + i], prefetching the tile after next (tile_rows) not past
// `stop`.
template <bool High, int R>
void k4_tile(const float* x, int64_t k, const uint8_t* row0, int64_t row_bytes, const uint8_t* stop, float* y,
             int64_t n) {
  constexpr int64_t bytes = High ? 176 : 144;  // a super-block
  constexpr int qs_at = High ? 48 : 16;        // its nibbles' first byte
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i quant = _mm512_set1_epi32(High ? 31 : 15);
  const uint8_t* rows[16];
  for (int64_t s = 0; s < k / 256; ++s) {
    tile_rows(row0, row_bytes, bytes, s, stop, rows);
    __m512i head[8], qh[8];  // bytes 0-31 (the head; Q5_K: qh 0-15 too), Q5_K: 32-63 (qh 16-31, qs 0-15)
    transpose16x8(rows, 0, head);
    if constexpr (High) transpose16x8(rows, 32, qh);
    __m512 scale[8], offset[8];
    k4_tile_scales(head, scale, offset);
    const float* xs = x + s * 256;
    for (int c = 0; c < 4; ++c) {
      __m512i v[8];
      transpose16x8(rows, qs_at + 32 * c, v);
#pragma GCC unroll 8
      for (int e = 0; e < 8; ++e) {
        // the quants of weights 4 e + b of sub-blocks 2 c and 2 c + 1 in byte b of each lane (bits above
        // them not yet cleared): Q5_K's fifth bits 2 c and 2 c + 1 of qh moved to bit 4
        __m512i lo = v[e], hi = _mm512_srli_epi32(v[e], 4);
        if constexpr (High) {
          const __m512i tops = e < 4 ? head[4 + e] : qh[e - 4];  // qh's dword e
          lo = low_nibbles_over(lo, shift_left(tops, 4 - 2 * c));
          hi = low_nibbles_over(hi, shift_left(tops, 3 - 2 * c));
        }
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) {
          const __m512i ql = _mm512_and_si512(_mm512_srli_epi32(lo, 8 * b), quant);
          const __m512i qu = _mm512_and_si512(_mm512_srli_epi32(hi, 8 * b), quant);
          const __m512 wl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ql), scale[2 * c], offset[2 * c]);
          const __m512 wh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qu), scale[2 * c + 1], offset[2 * c + 1]);
          const int weight = 64 * c + 4 * e + b;  // wl's weight; wh's is 32 further
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xs[r * k + weight]), acc[r]);
          for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xs[r * k + weight + 32]), acc[r]);
        }
      }
    }
  }
  const __m512i order = _mm512_load_si512(kLaneRows);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, _mm512_permutexvar_ps(order, acc[r]));
}

}  // namespace kiln_cpu
#endif
