// The row kernel of the exact K-quant kernels (kiln.ops.gemm.cpu_kquants): y = x @ W^T in float32 with
// W one or more parts of GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) kept as the file stores them (0.56 /
// 0.69 / 0.82 bytes a weight), each weight its exact float32 value, ggml's decode
// (cpu_kquants_decode.h); x is not rounded.
//
//   Q4_K / Q5_K  factored per sub-block of 32, as cpu_q4_blocks.cpp's kernels:
//                y = sum_j (d sc_j) sum_i q_i x_i  -  sum_j (dmin m_j) sum_i x_i
//                (x's sums per 32 computed once a call; the second sum eight lanes a super-block)
//   Q6_K         one fma(q - 32, d sc_j) per weight (exact), then one FMA into the row's sums
//
// with kOneRowAcc accumulators (sub-block or vector j into j % kOneRowAcc) added pairwise at the end, so
// that the one row keeps several FMA chains in flight. Two or more rows (rows_times_rows): up to kXRows
// x rows a pass against kWRows weight rows at once, each super-block unpacked once for the pass and each
// weight vector exact (fma(q, d sc_j, -(dmin m_j)) / (q - 32) * d sc_j), one FMA chain per (x row,
// weight row) pair; AVX2 builds' Q4_K rows factored as the one-row kernel, one accumulator per x row
// (rows_times_q4_k_row). From kTileMinRows rows on, AVX-512 builds run each whole group of 16 rows of one part
// as a tile transposed on the fly (cpu_k4_tiles.h: Q4_K, Q5_K; cpu_q6_k_tiles.h). A row's outputs are bit
// for bit the same whatever other rows share the call within each range, 2 .. kTileMinRows - 1 rows and
// from kTileMinRows on (the whole range from 2 on AVX2; the one-row kernel sums in its own order). Many
// rows go to the panel kernel (cpu_blocks_panel.cpp). Registered as torch.ops.kiln_cpu.kquants_gemm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_float_lanes.h"
#include "cpu_kquants_decode.h"
#include "cpu_k4_tiles.h"
#include "cpu_q6_k_tiles.h"
#include "native_cpu_ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

using kiln_cpu::kKQuantSuper, kiln_cpu::KQuant, kiln_cpu::KQuantUnpacked;
constexpr int64_t kGroupRows = 16;  // output rows a task takes at a time (a Q4_K tile's)

#if defined(KILN_FLOAT_LANES)
using namespace kiln_cpu::lanes;  // Floats: kLanes floats, 16 (AVX-512) or 8 (AVX2)
constexpr int kPieces = kKQuantSuper / kLanes;
constexpr int kOneRowAcc = 4;  // accumulators of the one-row kernel: FMA chains in flight for one row
// The several-row kernel (rows_times_rows): up to kXRows x rows a pass against kWRows weight rows at
// once, each x vector loaded serving them all. AVX-512 builds take 4 weight rows (16 accumulators of 32
// registers): with one weight row at a time the x rows' loads from L2 set the pace (a standalone
// microbenchmark, one Zen 4 thread, a 2048 x 2048 Q4_K matrix, 8 x rows: 1.25 -> 0.90 ms); AVX2 builds
// (16 registers) 2, against 4 / R before (the AVX2 build on a 2-core Zen 4, 4 Llama-3.2-1B-shaped layers
// cache-cold: 3 rows 18.6 -> 17.2 ms, 6 rows 35.6 -> 31.0, 10 rows 55.4 -> 47.6).
constexpr int kXRows = 4;
constexpr int kWRows = kLanes == 16 ? 4 : 2;
// x rows a pass of a Q6_K run: up to 8 on AVX2 builds, one weight row at a time (past kXRows two weight
// rows' unpacked super-blocks do not fit beside the chains). A standalone microbenchmark, one Zen 3
// thread, a 2048 x 2048 Q6_K matrix warm, three runs: 6 x rows 1.17-1.48 ms in one pass against
// 1.9-2.9 in two of 3; 8 rows 1.73-2.33 against 2.06-2.72 in two of 4.
constexpr int kQ6KXRows = kLanes == 16 ? kXRows : 8;

// Accumulators added pairwise, then across lanes
template <int A>
inline float total(const Floats (&acc)[A]) {
  if constexpr (A == 4) {
    return sum(add(add(acc[0], acc[1]), add(acc[2], acc[3])));
  } else {
    return sum(add(acc[0], acc[1]));
  }
}

// Q5_K: kLanes nibble bytes at p as floats, low and high nibbles, with bits `bit` and `bit + 1` of their
// qh bytes as their fifth bits. AVX-512: the qh bytes come widened to dwords, once a super-block for the
// four calls that read them (`QhBits`), and each fifth bit is a test and a masked or (one Zen 4 thread,
// a 2048 x 2048 Q5_K matrix, one row warm: 0.38 -> 0.32 ms against shifting and masking each time, as
// AVX2 builds do from the bytes' address).
#if defined(CPU_CAPABILITY_AVX512)
using QhBits = __m512i;
inline QhBits qh_bits(const uint8_t* qh) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh)));
}
inline void q5_k_nibbles(const uint8_t* p, QhBits qh, int bit, Floats& lo, Floats& hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i sixteen = _mm512_set1_epi32(16);
  const __m512i l = _mm512_and_si512(q, _mm512_set1_epi32(15)), h = _mm512_srli_epi32(q, 4);
  const __mmask16 fifth_lo = _mm512_test_epi32_mask(qh, _mm512_set1_epi32(1 << bit));
  const __mmask16 fifth_hi = _mm512_test_epi32_mask(qh, _mm512_set1_epi32(2 << bit));
  lo = _mm512_cvtepi32_ps(_mm512_mask_or_epi32(l, fifth_lo, l, sixteen));
  hi = _mm512_cvtepi32_ps(_mm512_mask_or_epi32(h, fifth_hi, h, sixteen));
}
#else
using QhBits = const uint8_t*;
inline QhBits qh_bits(const uint8_t* qh) { return qh; }
inline void q5_k_nibbles(const uint8_t* p, QhBits qh, int bit, Floats& lo, Floats& hi) {
  const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qh)));
  const __m256i low = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
  const __m256i l = _mm256_or_si256(_mm256_and_si256(q, low),
                                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(b, bit), one), 4));
  const __m256i h = _mm256_or_si256(_mm256_srli_epi32(q, 4),
                                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(b, bit + 1), one), 4));
  lo = _mm256_cvtepi32_ps(l);
  hi = _mm256_cvtepi32_ps(h);
}
#endif

// One row of x (K = supers * 256; xsum: its sums per 32) times one Q4_K / Q5_K weight row, factored per
// sub-block of 32 as cpu_q4_blocks.cpp's one-row kernel: sum_j (d sc_j) sum_i q_i x_i - (dmin m_j) sum_i x_i;
// `stop`: prefetch no further
template <bool High>
float one_row_k4(const float* x, const float* xsum, const uint8_t* row, int64_t supers, const uint8_t* stop) {
  constexpr int64_t bytes = High ? 176 : 144;
  constexpr int kParts = 32 / kLanes;
  Floats acc[kOneRowAcc];
  for (Floats& a : acc) a = zero();
  __m256 mins = _mm256_setzero_ps();
  alignas(32) float scale[8], offset[8];
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* b = row + s * bytes;
    kiln_cpu::prefetch_kquant_ahead(b, bytes, stop);
    kiln_cpu::k4_scale_offset(b, scale, offset);
    const uint8_t* qs = b + (High ? 48 : 16);
    const float* xs = x + s * kKQuantSuper;
    QhBits qh[kParts];  // Q5_K: its qh bytes part kLanes .. + kLanes - 1, for every c
    for (int part = 0; part < kParts && High; ++part) qh[part] = qh_bits(b + 16 + part * kLanes);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
      Floats tl = zero(), th = zero();
#pragma GCC unroll 4
      for (int part = 0; part < kParts; ++part) {
        Floats lo, hi;
        if constexpr (High) {
          q5_k_nibbles(qs + 32 * c + part * kLanes, qh[part], 2 * c, lo, hi);
        } else {
          nibbles(qs + 32 * c + part * kLanes, lo, hi);
        }
        tl = fmadd(lo, load(xs + 64 * c + part * kLanes), tl);
        th = fmadd(hi, load(xs + 64 * c + 32 + part * kLanes), th);
      }
      acc[(2 * c) % kOneRowAcc] = fmadd(set1(scale[2 * c]), tl, acc[(2 * c) % kOneRowAcc]);
      acc[(2 * c + 1) % kOneRowAcc] = fmadd(set1(scale[2 * c + 1]), th, acc[(2 * c + 1) % kOneRowAcc]);
    }
    mins = _mm256_fmadd_ps(_mm256_load_ps(offset), _mm256_loadu_ps(xsum + 8 * s), mins);
  }
  return total(acc) + kiln_cpu::hsum(mins);
}

// One row of x times one Q6_K weight row: each vector of weights exact (fma(q - 32, d sc_j)), then one
// FMA into the row's sums; `stop`: prefetch no further
float one_row_q6_k(const float* x, const uint8_t* row, int64_t supers, const uint8_t* stop) {
  constexpr int64_t bytes = 210;
  Floats acc[kOneRowAcc];
  for (Floats& a : acc) a = zero();
  kiln_cpu::KQuantUnpacked u;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* b = row + s * bytes;
    kiln_cpu::prefetch_kquant_ahead(b, bytes, stop);
    kiln_cpu::unpack<KQuant::kQ6K>(b, u);
#pragma GCC unroll 32
    for (int v = 0; v < kPieces; ++v) {
      const Floats w = kiln_cpu::weights<KQuant::kQ6K>(u, v);
      acc[v % kOneRowAcc] = fmadd(w, load(x + s * kKQuantSuper + v * kLanes), acc[v % kOneRowAcc]);
    }
  }
  return total(acc);
}

// x rows 0 .. R - 1 (K = k) times W consecutive weight rows of type T (`row_bytes` apart), each
// super-block of each weight row unpacked once for the R rows: y[r * n + j]. Every (x row, weight row)
// pair sums into one chain, vector after vector, whatever R and W are (batch invariant); each x vector
// loaded serves the W weight rows. `stop`: prefetch no further.
template <int R, int W, KQuant T>
void rows_times_rows(const float* x, int64_t k, const uint8_t* rows, int64_t row_bytes, const uint8_t* stop,
                     float* y, int64_t n) {
  constexpr int64_t bytes = T == KQuant::kQ4K ? 144 : T == KQuant::kQ5K ? 176 : 210;
  Floats acc[R][W];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < W; ++j) acc[r][j] = zero();
  }
  KQuantUnpacked u[W];
  for (int64_t s = 0; s < k / kKQuantSuper; ++s) {
    for (int j = 0; j < W; ++j) {
      const uint8_t* b = rows + j * row_bytes + s * bytes;
      kiln_cpu::prefetch_kquant_ahead(b, bytes, stop);
      kiln_cpu::unpack<T>(b, u[j]);
    }
#pragma GCC unroll 32
    for (int v = 0; v < kPieces; ++v) {
      Floats xv[R];
      for (int r = 0; r < R; ++r) xv[r] = load(x + r * k + s * kKQuantSuper + v * kLanes);
      for (int j = 0; j < W; ++j) {
        const Floats w = kiln_cpu::weights<T>(u[j], v);
        for (int r = 0; r < R; ++r) acc[r][j] = fmadd(w, xv[r], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < W; ++j) y[r * n + j] = sum(acc[r][j]);
  }
}

#if !defined(CPU_CAPABILITY_AVX512)
// AVX2 builds, Q4_K: x rows 0 .. R - 1 (K = k; xsum: their sums per 32, k / 32 apart) times one weight
// row, factored per sub-block of 32 as the one-row kernel is: one accumulator per x row takes
// -(dmin m_j) xsum_j (eight lanes a super-block), then (d sc_j) sum_i q_i x_i sub-block by sub-block,
// the same sums whatever R is (batch invariant). Each nibble vector is converted once for the R rows and
// no weight is decoded. A standalone microbenchmark, one Zen 3 thread, a 2048 x 2048 Q4_K matrix warm,
// against rows_times_rows with 2 weight rows (each weight exact), ms: 2 x rows 0.61 -> 0.43, 3 rows
// 0.71 -> 0.55, 4 rows 0.90 -> 0.79; 8 rows a pass 1.78, no better than two passes of 4. (Q5_K's fifth
// bits made the same scheme 0.9x there.)
template <int R>
void rows_times_q4_k_row(const float* x, const float* xsum, int64_t k, const uint8_t* row, const uint8_t* stop,
                         float* y, int64_t n) {
  constexpr int64_t bytes = 144;
  Floats acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero();
  alignas(32) float scale[8], offset[8];
  for (int64_t s = 0; s < k / kKQuantSuper; ++s) {
    const uint8_t* b = row + s * bytes;
    kiln_cpu::prefetch_kquant_ahead(b, bytes, stop);
    kiln_cpu::k4_scale_offset(b, scale, offset);
    const Floats mins = load(offset);
    for (int r = 0; r < R; ++r) acc[r] = fmadd(mins, load(xsum + r * (k / 32) + 8 * s), acc[r]);
    const float* xs = x + s * kKQuantSuper;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // sub-block j: the low (even j) or high nibbles of bytes 32 (j / 2) ..
      Floats q[4];
      for (int part = 0; part < 4; ++part) {
        const __m256i bytes8 =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16 + 32 * (j / 2) + 8 * part)));
        q[part] = _mm256_cvtepi32_ps(j % 2 ? _mm256_srli_epi32(bytes8, 4)
                                           : _mm256_and_si256(bytes8, _mm256_set1_epi32(15)));
      }
      const Floats sc = set1(scale[j]);
      for (int r = 0; r < R; ++r) {
        const float* xv = xs + r * k + 32 * j;
        Floats t = mul(q[0], load(xv));
        for (int part = 1; part < 4; ++part) t = fmadd(q[part], load(xv + 8 * part), t);
        acc[r] = fmadd(sc, t, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * n] = sum(acc[r]);
}
#endif

// R x rows (xsum: their sums per 32) against `count` weight rows of one part (type T) from row0: kWRows
// at a time (one past kXRows x rows: AVX2 builds' Q6_K passes), then one at a time; on AVX2 builds Q4_K
// rows one at a time through rows_times_q4_k_row
template <int R, KQuant T>
void rows_times_part(const float* x, const float* xsum, int64_t k, const uint8_t* row0, int64_t row_bytes,
                     int64_t count, const uint8_t* stop, float* y, int64_t n) {
#if !defined(CPU_CAPABILITY_AVX512)
  if constexpr (T == KQuant::kQ4K) {
    for (int64_t j = 0; j < count; ++j) rows_times_q4_k_row<R>(x, xsum, k, row0 + j * row_bytes, stop, y + j, n);
    return;
  }
#endif
  constexpr int W = R > kXRows ? 1 : kWRows;
  int64_t j = 0;
  for (; j + W <= count; j += W) rows_times_rows<R, W, T>(x, k, row0 + j * row_bytes, row_bytes, stop, y + j, n);
  for (; j < count; ++j) rows_times_rows<R, 1, T>(x, k, row0 + j * row_bytes, row_bytes, stop, y + j, n);
}

using PartFn = void (*)(const float*, const float*, int64_t, const uint8_t*, int64_t, int64_t, const uint8_t*,
                       float*, int64_t);
template <KQuant T, int... Rs>
constexpr std::array<PartFn, kQ6KXRows> part_table(std::integer_sequence<int, Rs...>) {
  return {&rows_times_part<Rs + 1, T>...};  // null past the type's x rows a pass
}
// kPartFns[type][R - 1]: R x rows against a run of Q4_K / Q5_K / Q6_K rows
constexpr std::array<std::array<PartFn, kQ6KXRows>, 3> kPartFns = {
    part_table<KQuant::kQ4K>(std::make_integer_sequence<int, kXRows>{}),
    part_table<KQuant::kQ5K>(std::make_integer_sequence<int, kXRows>{}),
    part_table<KQuant::kQ6K>(std::make_integer_sequence<int, kQ6KXRows>{}),
};

// f(m0, rows) for x rows [0, m) in passes of at most `most` rows, as even as they go
template <typename F>
inline void for_passes(int64_t m, int64_t most, const F& f) {
  const int64_t passes = (m + most - 1) / most;
  for (int64_t pass = 0, m0 = 0; pass < passes; ++pass) {
    const int64_t rows = m / passes + (pass < m % passes ? 1 : 0);
    f(m0, rows);
    m0 += rows;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
using TileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, const uint8_t*, float*, int64_t);
// From kTileMinRows x rows on, whole groups of rows of a part run as tiles: with fewer the tile's decode
// and transposition serve too few FMAs (cache-cold, Llama-3.2-1B-shaped Q4_K linears on a 2-core Zen 4,
// tiles / rows_times_rows: 2 rows 15.0 / 13.0 ms, 4 rows 18.6 / 17.3, 5 rows 20.0 / 20.6, 6 rows 22.7 /
// 28.1). Warm, one thread, a 2048 x 2048 matrix, rows_times_rows -> tiles, 8 rows: Q5_K 1.01 -> 0.79 ms,
// Q6_K 0.93 -> 0.82; 16 rows 2.06 -> 1.59, 1.86 -> 1.62.
constexpr int kTileMinRows = 5;
constexpr int kTileXRows = 10;  // x rows a pass of a tile: its accumulators stay in registers
template <KQuant T, int... Rs>
constexpr std::array<TileFn, sizeof...(Rs)> tile_table(std::integer_sequence<int, Rs...>) {
  if constexpr (T == KQuant::kQ6K) {
    return {&kiln_cpu::q6_k_tile<Rs + 1>...};
  } else {
    return {&kiln_cpu::k4_tile<T == KQuant::kQ5K, Rs + 1>...};
  }
}
// kTileFns[type][R - 1]: R x rows against a tile of Q4_K / Q5_K / Q6_K rows
constexpr std::array<std::array<TileFn, kTileXRows>, 3> kTileFns = {
    tile_table<KQuant::kQ4K>(std::make_integer_sequence<int, kTileXRows>{}),
    tile_table<KQuant::kQ5K>(std::make_integer_sequence<int, kTileXRows>{}),
    tile_table<KQuant::kQ6K>(std::make_integer_sequence<int, kTileXRows>{}),
};
#endif

// x rows [0, m) times output rows [begin, end) of the weight. One row: the one-row kernels; more:
// rows_times_rows and, from kTileMinRows rows on AVX-512 builds, the tiles (batch invariant within
// each range: the header comment).
void rows_kernel(const float* x, const float* xsum, int64_t m, int64_t k, const kiln_cpu::KQuantParts& parts,
                 const uint8_t* bp, int64_t begin, int64_t end, float* y, int64_t n) {
  const int64_t supers = k / kKQuantSuper;
  int64_t part = 0;
  if (m == 1) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = kiln_cpu::kquant_row(parts, bp, supers, r, part);
      const int64_t type = parts.types[part];
      const int64_t last = std::min(end, parts.first_row[part + 1]);
      const uint8_t* stop = row + (last - r) * supers * kiln_cpu::gguf_block(type).bytes;
      if (type == kiln_cpu::kGgmlQ4K) {
        y[r] = one_row_k4<false>(x, xsum, row, supers, stop);
      } else if (type == kiln_cpu::kGgmlQ5K) {
        y[r] = one_row_k4<true>(x, xsum, row, supers, stop);
      } else {
        y[r] = one_row_q6_k(x, row, supers, stop);
      }
    }
    return;
  }
  // Per group of 16 output rows (absolute: a row's kernel does not depend on the task split) and per part's
  // run of rows in it: AVX-512 builds run a whole group of one part's rows as one tile (cpu_k4_tiles.h,
  // cpu_q6_k_tiles.h), other runs through rows_times_part. x rows in passes as even as they go (at most
  // kTileXRows / kXRows / kQ6KXRows a pass: 6 rows of the row kernel run 3 + 3, not 4 + 2), prefetching on
  // the first pass only.
  for (int64_t group = begin; group < end;) {
    const int64_t group_end = std::min(end, (group / kGroupRows + 1) * kGroupRows);
    for (int64_t r = group; r < group_end;) {
      const uint8_t* row = kiln_cpu::kquant_row(parts, bp, supers, r, part);
      const int64_t type = parts.types[part], row_bytes = supers * kiln_cpu::gguf_block(type).bytes;
      const int64_t count = std::min(group_end, parts.first_row[part + 1]) - r;
      const uint8_t* stop = row + (std::min(end, parts.first_row[part + 1]) - r) * row_bytes;  // prefetch
      const int kind = type == kiln_cpu::kGgmlQ4K ? 0 : type == kiln_cpu::kGgmlQ5K ? 1 : 2;
#if defined(CPU_CAPABILITY_AVX512)
      const bool fits = kind != 2 || kiln_cpu::q6_k_tile_fits(row_bytes);  // Q6_K's gathers
      if (m >= kTileMinRows && fits && count == kiln_cpu::kTileRows) {
        const auto& tiles = kTileFns[kind];
        for_passes(m, kTileXRows, [&](int64_t m0, int64_t rows) {
          tiles[rows - 1](x + m0 * k, k, row, row_bytes, m0 == 0 ? stop : row, y + m0 * n + r, n);
        });
        r += count;
        continue;
      }
#endif
      const auto& fns = kPartFns[kind];
      for_passes(m, kind == 2 ? kQ6KXRows : kXRows, [&](int64_t m0, int64_t rows) {
        fns[rows - 1](x + m0 * k, xsum + m0 * (k / 32), k, row, row_bytes, count, m0 == 0 ? stop : row,
                      y + m0 * n + r, n);
      });
      r += count;
    }
    group = group_end;
  }
}
#else
// Scalar builds: the same weights, one float32 sum per output in k order (also batch invariant)
void rows_kernel(const float* x, const float* /*xsum*/, int64_t m, int64_t k, const kiln_cpu::KQuantParts& parts,
                 const uint8_t* bp, int64_t begin, int64_t end, float* y, int64_t n) {
  const int64_t supers = k / kKQuantSuper;
  std::vector<float> w(k);
  for (int64_t r = begin; r < end; ++r) {
    kiln_cpu::kquant_row_weights(parts, bp, supers, r, w.data());
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j) acc = std::fma(w[j], x[i * k + j], acc);
      y[i * n + r] = acc;
    }
  }
}
#endif

}  // namespace

namespace kiln_cpu {

at::Tensor kquants_gemm(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, int64_t n) {
  const KQuantParts table = check_kquant_args("kquants_gemm", x, blocks, parts, n);
  const int64_t m = x.size(0), k = x.size(1);
  const at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // x's sums per 32: the one-row kernel's and AVX2 builds' several-row Q4_K kernel's (both factored)
  const std::vector<float> xsum = block_sums(xp, m, k);
  at::parallel_for(0, (n + kGroupRows - 1) / kGroupRows, 1, [&](int64_t begin, int64_t end) {
    rows_kernel(xp, xsum.data(), m, k, table, bp, begin * kGroupRows, std::min(n, end * kGroupRows), yp, n);
  });
  return y;
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) { m.def("kquants_gemm(Tensor x, Tensor blocks, Tensor parts, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("kquants_gemm", &kiln_cpu::kquants_gemm); }
