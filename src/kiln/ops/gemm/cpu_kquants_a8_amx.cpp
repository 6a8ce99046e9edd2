// The a8 K-quant GEMM (kquants_a8_gemm, cpu_kquants_a8.cpp) on Intel AMX tiles, for 16 weight rows of
// one type at a time: each super-block's integer dot products, exact, as int8 tile products, then the
// float32 steps of the row kernels, in their order, so each output is bit for bit what kquants_a8_gemv
// gives for that row of x alone (cpu_kquants_a8.h).
//
// Each weight is first multiplied by its sub-block's scale in int16, p = q sc_j (Q4_K / Q5_K: at most
// 31 * 63) or p = (q - 32) sc_j (Q6_K: |p| <= 32 * 128), and split into bytes, p = 256 hi + lo (lo
// unsigned, hi signed), once per super-block for every 16 rows of x. Then per super-block, weight rows n
// and rows m of x (B: Q8KTiles' layout), over its 4 chunks of 64:
//
//   I[n][m] = lo . qx + 256 (hi . qx) = sum_j sc_j sum_i q qx   (Q6_K: its -32 offset included)
//
// the integer the row kernels form; Q4_K / Q5_K's min term M = sum_j m_j sums32_j[m] in int16 pairs.
// Then acc += (d dx) I and macc += (dmin dx) M, y = acc - macc (Q6_K: acc).

#include <ATen/Parallel.h>

#include "cpu_amx.h"
#include "cpu_gguf_fields.h"
#include "cpu_kquants_a8.h"
#include "cpu_kquants_decode.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace kiln_cpu {

namespace {

constexpr int64_t kSuper = 256;
constexpr int64_t kRows = 16;  // rows of a tile: of weights in A, of x in B's lanes

}  // namespace

Q8KTiles::Q8KTiles(const Q8KRows& x)
    : m(x.m), k(x.k), blocks((x.m + kRows - 1) / kRows), supers(x.k / kSuper),
      vnni(blocks * kRows * x.k, 0), d(blocks * supers * kRows, 0.f), sums32(blocks * supers * 4 * kRows, 0) {
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t i = 0; i < kRows && b * kRows + i < m; ++i) {
        const int64_t r = b * kRows + i;
        const int8_t* q = x.q + r * k;
        int8_t* out = vnni.data() + b * kRows * k + 4 * i;
        for (int64_t c = 0; c < k / 4; ++c) std::memcpy(out + c * 4 * kRows, q + 4 * c, 4);
        for (int64_t s = 0; s < supers; ++s) {
          const int64_t at = (b * supers + s) * kRows + i;
          d[at] = x.d[r * supers + s];
          const int16_t* s32 = x.sums32 + r * (k / 32) + 8 * s;
          for (int p = 0; p < 4; ++p) {
            sums32[(b * supers + s) * 4 * kRows + p * kRows + i] =
                static_cast<int32_t>(static_cast<uint16_t>(s32[2 * p]) | (static_cast<uint32_t>(s32[2 * p + 1]) << 16));
          }
        }
      }
    }
  });
}

#ifdef KILN_AMX

namespace {

constexpr int64_t kChunk = 64;  // k per tile product: a tile row of int8

// One super-block of 16 weight rows ready for the tiles: each weight's quant times its sub-block's
// scale (Q6_K: (q - 32) sc), p, as two bytes, p = 256 hi + lo: lo [chunk][row][64] unsigned, hi likewise
// signed; per row d (and dmin, and the mins in int16 pairs, as Q8KTiles' sums32 pairs them)
struct Scaled {
  alignas(64) uint8_t lo[4][kRows][kChunk];
  alignas(64) int8_t hi[4][kRows][kChunk];
  alignas(64) int32_t min_pairs[kRows][4];
  alignas(64) float d[kRows], dmin[kRows];
};

inline int32_t int16_pair(int a, int b) {
  return static_cast<int32_t>(static_cast<uint16_t>(a) | (static_cast<uint32_t>(static_cast<uint16_t>(b)) << 16));
}

// The tile kernel's vector steps use AVX512-VBMI (one byte permute splits 32 int16 into their low and high
// bytes) and AVX512-VNNI (vpdpwssd for the mins); every CPU with AMX has both (kquants_a8_amx_usable checks)
#define KILN_AMX_VECTOR "avx512vbmi,avx512vnni"

// vpermb's indices: the low bytes of 32 int16 (bytes 0, 2, .., 62), then their high bytes
__attribute__((target(KILN_AMX_VECTOR))) inline __m512i low_then_high_bytes() {
  return _mm512_set_epi8(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21,
                         19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36,
                         34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
}

// 32 products p (int16, |p| < 2^15) -> their low bytes and high bytes at weights `at` .. `at` + 31 of row i
__attribute__((target(KILN_AMX_VECTOR))) inline void store_scaled(__m512i p, int at, int i, Scaled& u) {
  const __m512i bytes = _mm512_permutexvar_epi8(low_then_high_bytes(), p);
  _mm256_store_si256(reinterpret_cast<__m256i*>(&u.lo[at / kChunk][i][at % kChunk]), _mm512_castsi512_si256(bytes));
  _mm256_store_si256(reinterpret_cast<__m256i*>(&u.hi[at / kChunk][i][at % kChunk]),
                     _mm512_extracti64x4_epi64(bytes, 1));
}

// Q4_K (High = false) / Q5_K super-block `b` -> row i of u. p = q sc_j <= 31 * 63.
template <bool High>
__attribute__((target(KILN_AMX_VECTOR))) inline void scale_k4(const uint8_t* b, int i, Scaled& u) {
  uint32_t sc[2], mn[2];
  k4_scales(b + 4, sc, mn);
  const auto byte = [](const uint32_t* w, int j) { return static_cast<int>((w[j / 4] >> (8 * (j % 4))) & 0xFF); };
  for (int p = 0; p < 4; ++p) u.min_pairs[i][p] = int16_pair(byte(mn, 2 * p), byte(mn, 2 * p + 1));
  u.d[i] = fp16_at(b);
  u.dmin[i] = fp16_at(b + 2);
  __m256i quants[8];  // weights 32 j .. 32 j + 31: sub-block j
  k4_quants<High>(b, quants);
  for (int j = 0; j < 8; ++j) {
    store_scaled(_mm512_mullo_epi16(_mm512_cvtepu8_epi16(quants[j]), _mm512_set1_epi16(byte(sc, j))), 32 * j, i, u);
  }
}

// Q6_K super-block `b` -> row i of u. p = (q - 32) sc_j, |p| <= 32 * 128.
__attribute__((target(KILN_AMX_VECTOR))) inline void scale_q6_k(const uint8_t* b, int i, Scaled& u) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  u.d[i] = fp16_at(b + 208);
  const __m512i bias = _mm512_set1_epi16(32);
  for (int h = 0; h < 2; ++h) {
    __m256i quants[4];  // weights 128 h + 32 t .. + 31: sub-blocks 8 h + 2 t and the one after
    q6_k_half(b, h, quants);
    for (int t = 0; t < 4; ++t) {
      const int j = 8 * h + 2 * t;
      const __m512i scale = _mm512_inserti64x4(_mm512_set1_epi16(sc[j]), _mm256_set1_epi16(sc[j + 1]), 1);
      const __m512i q = _mm512_sub_epi16(_mm512_cvtepu8_epi16(quants[t]), bias);
      store_scaled(_mm512_mullo_epi16(q, scale), 128 * h + 32 * t, i, u);
    }
  }
}

// 16 weight rows of type Q4_K / Q5_K (K6 = false) or Q6_K, times all of x. Per super-block and 16 rows
// of x: I = lo . x + 256 (hi . x) over the super-block's 4 chunks of 64 (C tiles: lo and hi for two
// 16-row blocks of x at a time, tmm0-3; A: lo, hi in tmm4-5; B: x in tmm6-7).
template <bool K6, bool High>
__attribute__((target("amx-tile,amx-int8," KILN_AMX_VECTOR))) void amx_rows(const Q8KTiles& x, const uint8_t* rows,
                                                                           int64_t row_bytes, float* y, int64_t n,
                                                                           int64_t n0) {
  constexpr int64_t kBytes = K6 ? 210 : (High ? 176 : 144);
  const int64_t blocks = x.blocks, supers = x.supers;
  std::vector<__m512> acc(blocks * kRows, _mm512_setzero_ps()), macc(K6 ? 0 : blocks * kRows, _mm512_setzero_ps());
  Scaled u;
  alignas(64) int32_t c[4][kRows * kRows];
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = kRows, config.colsb[t] = kChunk;
  load_tile_config(config);
  for (int64_t s = 0; s < supers; ++s) {
    for (int i = 0; i < kRows; ++i) {
      const uint8_t* b = rows + i * row_bytes + s * kBytes;
      if constexpr (K6) {
        scale_q6_k(b, i, u);
      } else {
        scale_k4<High>(b, i, u);
      }
    }
    for (int64_t mb = 0; mb < blocks; mb += 2) {
      const bool pair = mb + 1 < blocks;
      const int8_t* b0 = x.vnni.data() + mb * kRows * x.k + kRows * kSuper * s;
      const int8_t* b1 = b0 + kRows * x.k;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int ch = 0; ch < 4; ++ch) {
        _tile_loadd(4, u.lo[ch], kChunk);
        _tile_loadd(5, u.hi[ch], kChunk);
        _tile_loadd(6, b0 + kRows * kChunk * ch, 64);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbssd(1, 5, 6);
        if (pair) {
          _tile_loadd(7, b1 + kRows * kChunk * ch, 64);
          _tile_dpbusd(2, 4, 7);
          _tile_dpbssd(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      if (pair) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
      }
      for (int64_t e = 0; e < (pair ? 2 : 1); ++e) {
        const int64_t at = (mb + e) * supers + s;
        const __m512 dx = _mm512_loadu_ps(x.d.data() + at * kRows);
        __m512i sums32[4];
        for (int p = 0; p < 4 && !K6; ++p) sums32[p] = _mm512_loadu_si512(x.sums32.data() + (at * 4 + p) * kRows);
        for (int i = 0; i < kRows; ++i) {
          const __m512i isum = _mm512_add_epi32(_mm512_load_si512(c[2 * e] + kRows * i),
                                                _mm512_slli_epi32(_mm512_load_si512(c[2 * e + 1] + kRows * i), 8));
          __m512& a = acc[(mb + e) * kRows + i];
          a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(u.d[i]), dx), _mm512_cvtepi32_ps(isum), a);
          if constexpr (!K6) {
            __m512i mins = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p) {
              mins = _mm512_dpwssd_epi32(mins, sums32[p], _mm512_set1_epi32(u.min_pairs[i][p]));
            }
            __m512& ma = macc[(mb + e) * kRows + i];
            ma = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(u.dmin[i]), dx), _mm512_cvtepi32_ps(mins), ma);
          }
        }
      }
    }
  }
  release_tiles();
  // lane l of acc[mb][i]: y[16 mb + l, n0 + i]
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int32_t>(n)));
  for (int64_t mb = 0; mb < blocks; ++mb) {
    const int64_t live = std::min<int64_t>(kRows, x.m - mb * kRows);
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1u);
    for (int i = 0; i < kRows; ++i) {
      __m512 v = acc[mb * kRows + i];
      if constexpr (!K6) v = _mm512_sub_ps(v, macc[mb * kRows + i]);
      _mm512_mask_i32scatter_ps(y + mb * kRows * n + n0 + i, mask, lanes, v, 4);
    }
  }
}

}  // namespace

bool kquants_a8_amx_usable() {
  static const bool wanted = [] {  // KILN_CPU_AMX=0: the row kernels instead (for comparisons)
    const char* value = std::getenv("KILN_CPU_AMX");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  static const bool vector = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni");
  return wanted && vector && amx_int8_usable();
}

void kquants_a8_amx_rows(const Q8KTiles& x, int64_t type, const uint8_t* rows, int64_t row_bytes, float* y,
                         int64_t n, int64_t n0) {
  with_kquant(type, [&](auto kind) {
    constexpr KQuant T = decltype(kind)::value;
    amx_rows<T == KQuant::kQ6K, T == KQuant::kQ5K>(x, rows, row_bytes, y, n, n0);
  });
}

#else  // no AMX in this build

bool kquants_a8_amx_usable() { return false; }

void kquants_a8_amx_rows(const Q8KTiles&, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t) {}

#endif

}  // namespace kiln_cpu
