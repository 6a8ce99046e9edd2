// The kernels of the a8 layouts' K-quant form (kiln.ops.gemm.cpu_kquants_a8): y = x @ W^T with W
// one or more parts of GGUF K-quant blocks kept as the file stores them (Q4_K: 144 bytes per 256
// weights, Q5_K: 176, Q6_K: 210) and x quantized first to Q8_K: per 256 values one float32
// d = max|x| / 127 and int8 q = round(x / d), half away from zero, and q's sum over each 16 and 32.
// That is llama.cpp's CPU arithmetic for these types; each super-block's dot product is then integer:
//
//   Q4_K / Q5_K (w = d sc_j q - dmin m_j per 32, q in 0..15 / 0..31, sc_j, m_j 6-bit):
//     y += dx (d sum_j sc_j sum_i q qx  -  dmin sum_j m_j sum_i qx)
//   Q6_K (w = d sc_j (q - 32) per 16, q in 0..63, sc_j int8):
//     y += dx d (sum_j sc_j sum_i q qx  -  32 sum_j sc_j sum_i qx)
//
// so y = W @ x' in float32 with x' = dx * qx: x's rounding to 255 levels per 256 values is the only
// approximation. The kernels read 0.56 / 0.69 / 0.82 bytes a weight, where the q4_blocks / q8_blocks
// forms of the same matrices read 0.75 / 1.25 / 1.25 (a stacked one with mins 1.5), and never convert a
// weight to float32.
//
// AVX2's vpmaddubsw multiplies the unsigned weight bytes by the signed qx into int16 pair sums (at most
// 63 * 127 * 2 = 16002: no saturation), vpmaddwd then weights each pair sum with its sub-block's scale
// into int32 (builds with AVX-512 VNNI: vpdpwssd, the same and the int32 accumulation in one). A NaN
// or an infinity in a super-block of x makes its dx NaN, so it reaches every output.
//
// Each super-block's dot product (and Q4_K / Q5_K's min term) is one exact int32, added to the output as
// acc = fma(d dx, float(I), acc), super-block after super-block (cpu_kquants_a8.h), so an output does
// not depend on how a kernel splits the integer sums. Several rows of x (kquants_a8_gemm) run in groups
// of up to eight (AVX-512 builds; else four) against each weight row, which is unpacked once per group;
// on CPUs with AMX-INT8, from kAmxRows rows, each part's whole 16-row blocks of weights run on tiles
// instead (cpu_kquants_a8_amx.cpp). Either way a row's outputs are bit for bit the one-row kernel's
// (kquants_a8_gemv) whatever rows share its call (batch invariant: a sequence's tokens do not depend on
// the batch it decodes in, nor a verified draft's on its length).
// Registered as torch.ops.kiln_cpu.quantize_q8_k, kquants_a8_gemv and kquants_a8_gemm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_float_lanes.h"
#include "cpu_gguf_fields.h"
#include "cpu_kquants_a8.h"
#include "cpu_kquants_decode.h"
#include "cpu_q8_activations.h"
#include "native_cpu_ops.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kSuper = 256;  // weights per K-quant super-block, values per Q8_K block of x
constexpr int64_t kRowsPerTask = 16;
// x rows one pass over a weight row reads (each weight vector unpacked once for them): 8 where AVX-512's 32
// vector registers hold their sums (2-core Zen 4, prefill-sized x: 5-14 % faster than 4), else 4
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kGroup = 8;
#else
constexpr int64_t kGroup = 4;
#endif
// x rows from which kquants_a8_gemm runs whole 16-row blocks of weights on AMX tiles, where it can:
// 2-core Xeon (AMX), 4 Llama-3.2-1B-shaped Q4_K_M layers cache-cold (scripts/cpu_kquants_rows.py), two
// runs, tiles / row kernels ms: 8 rows 50.2 / 34.2, 38.3 / 26.5; 10: 51.2 / 50.9, 39.9 / 39.8; 12:
// 51.7 / 55.9, 38.7 / 50.4; 16: 52.5 / 66.3, 42.0 / 59.2
constexpr int64_t kAmxRows = 12;
// GGML's type ids, as the parts table names them
using kiln_cpu::kGgmlQ4K, kiln_cpu::kGgmlQ5K, kiln_cpu::kGgmlQ6K;

// x float32 [K] -> q int8 [K], d float32 [K / 256], q's sums int16 per 16 [K / 16] and per 32 [K / 32]
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, int16_t* sums16, int16_t* sums32) {
  for (int64_t s = 0; s < k / kSuper; ++s) d[s] = kiln_cpu::quantize_int8_block(x + s * kSuper, kSuper, q + s * kSuper);
  for (int64_t j = 0; j < k / 16; ++j) {
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) sum += q[16 * j + i];
    sums16[j] = static_cast<int16_t>(sum);
  }
  for (int64_t j = 0; j < k / 32; ++j) sums32[j] = static_cast<int16_t>(sums16[2 * j] + sums16[2 * j + 1]);
}

// x [M, K] in Q8_K form: int8 values, d per 256, q's sums per 16 and per 32, row after row
struct Q8K {
  int64_t k, supers;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sums16, sums32;
  Q8K(int64_t m, int64_t k_)
      : k(k_), supers(k_ / kSuper), q(m * k_), d(m * supers), sums16(m * (k_ / 16)), sums32(m * (k_ / 32)) {}
  void quantize(int64_t r, const float* x) {
    quantize_row(x, k, q.data() + r * k, d.data() + r * supers, sums16.data() + r * (k / 16),
                 sums32.data() + r * (k / 32));
  }
};

using kiln_cpu::k4_scales;
using kiln_cpu::fp16_at;

#if defined(KILN_FLOAT_LANES)
// a vpshufb mask repeating int16 element `low` of the low 128-bit lane and `high` of the high lane
inline __m256i repeat16(int low, int high) {
  alignas(32) int8_t bytes[32];
  for (int i = 0; i < 32; ++i) bytes[i] = static_cast<int8_t>(2 * (i < 16 ? low : high) + i % 2);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
}
#endif

// x's Q8_K form for the R rows of x one kernel call reads against a weight row: each row's int8 values,
// d per 256 and q's sums per 16 and per 32
template <int R>
struct XRows {
  const int8_t* q[R];
  const float* d[R];
  const int16_t* sums16[R];
  const int16_t* sums32[R];
};

#if defined(KILN_FLOAT_LANES)
// lane m < R: the sum of v[m]'s lanes (exact); lanes from R on zero
template <int R>
inline __m256i lane_sums(const __m256i (&v)[R]) {
  static_assert(R <= 8, "at most 8 rows");
  const __m256i zero = _mm256_setzero_si256();
  const auto row = [&](int m) { return m < R ? v[m] : zero; };
  const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(row(0), row(1)), _mm256_hadd_epi32(row(2), row(3)));
  const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(row(4), row(5)), _mm256_hadd_epi32(row(6), row(7)));
  return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31));
}

template <int R>
inline __m256i lane_sums(const __m128i (&v)[R]) {
  __m256i wide[R];
  for (int m = 0; m < R; ++m) wide[m] = _mm256_zextsi128_si256(v[m]);
  return lane_sums<R>(wide);
}

// R rows' float32 sums against one weight row, each added to super-block after super-block as
// cpu_kquants_a8.h says: lane m of one vector for row m, so that the R rows' integer sums of a
// super-block are reduced together
template <int R>
struct RowSums {
  __m256 lanes = _mm256_setzero_ps();
  // scale: the weight super-block's d (or dmin); s: the super-block; isum[m]: row m's integer sums, in lanes
  template <typename Ints>
  void add(float scale, const XRows<R>& x, int64_t s, const Ints (&isum)[R]) {
    alignas(32) float dx[8] = {};
    for (int m = 0; m < R; ++m) dx[m] = x.d[m][s];
    const __m256 step = _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_load_ps(dx));
    lanes = _mm256_fmadd_ps(step, _mm256_cvtepi32_ps(lane_sums<R>(isum)), lanes);
  }
  // y[m * stride] = row m's sum less `minus`'s (nullptr: none)
  void store(float* y, int64_t stride, const RowSums* minus = nullptr) const {
    alignas(32) float out[8];
    _mm256_store_ps(out, minus ? _mm256_sub_ps(lanes, minus->lanes) : lanes);
    for (int m = 0; m < R; ++m) y[m * stride] = out[m];
  }
};

// One row of x: a Q4_K / Q5_K super-block's integer sums I (isum's lanes) and M (mins') into lanes 0 and 1
// of `sums` (the row's sum and its mins' sum), as RowSums does for several rows
inline void add_k4_super_block(__m128 d_dmin, float dx, __m256i isum, __m128i mins, __m128& sums) {
  const __m256i pairs = _mm256_hadd_epi32(isum, _mm256_zextsi128_si256(mins));  // I 01 23, M 01 23 | I 45 67
  const __m256i quads = _mm256_hadd_epi32(pairs, pairs);                         // I 0-3, M | I 4-7, 0
  const __m128i totals = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
  sums = _mm_fmadd_ps(_mm_mul_ps(d_dmin, _mm_set1_ps(dx)), _mm_cvtepi32_ps(totals), sums);
}
#endif

// One Q4_K (High = false) or Q5_K (High = true) row of `supers` super-blocks times R rows of x, into
// y[m * stride]. Q5_K: the 32 bytes qh after the scales hold bit 4 of each weight, bit j of byte i for
// weight i of sub-block j. Each weight vector is unpacked once for the R rows; each (weight row, x row)
// pair takes the same operations in the same order whatever R is, so a row's outputs do not depend on
// the rows beside it. `stop` as for q6_k_rows; AVX2 builds prefetch, AVX-512 builds do not (a 2-core Zen 4
// ran the Q4_K kernel ~8 % faster cache-cold without, being compute-bound there; on a 2-core Zen 3, AVX2,
// a standalone one-thread test of the one-row kernel over 56 MB of Q4_K read 5.3 GB/s without, 6.9 with).
template <bool High, int R>
void k4_rows(const XRows<R>& x, const uint8_t* row, int64_t supers, const uint8_t* stop, float* y,
             int64_t stride) {
  constexpr int64_t kBytes = High ? 176 : 144;
#if defined(KILN_FLOAT_LANES)
  constexpr int64_t kNibbles = High ? 48 : 16;  // where the 128 nibble bytes start
  const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  const __m256i pick[8] = {repeat16(0, 0), repeat16(1, 1), repeat16(2, 2), repeat16(3, 3),
                           repeat16(4, 4), repeat16(5, 5), repeat16(6, 6), repeat16(7, 7)};
  RowSums<R> acc, mins_acc;
  __m128 one_row = _mm_setzero_ps();  // R = 1: the row's sum and its mins' sum
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* b = row + s * kBytes;
#if !defined(CPU_CAPABILITY_AVX512)
    kiln_cpu::prefetch_kquant_ahead(b, kBytes, stop);
#endif
    uint32_t sc[2], mn[2];
    k4_scales(b + 4, sc, mn);
    // int16: sc 0-7 in the low lane, m 0-7 in the high one
    const __m256i scales_mins = _mm256_cvtepu8_epi16(_mm_set_epi32(mn[1], mn[0], sc[1], sc[0]));
    int32_t d_dmin;
    std::memcpy(&d_dmin, b, 4);
    const __m128 d_half = _mm_cvtph_ps(_mm_cvtsi32_si128(d_dmin));
    __m256i isum[R];
    __m128i mins[R];
    for (int m = 0; m < R; ++m) {
      mins[m] = _mm_madd_epi16(_mm256_extracti128_si256(scales_mins, 1),
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.sums32[m] + 8 * s)));
      isum[m] = _mm256_setzero_si256();
    }
    const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(scales_mins));
    const __m256i qh = High ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
    const uint8_t* qs = b + kNibbles;
    for (int j = 0; j < 4; ++j) {  // 32 bytes: sub-block 2j in the low nibbles, 2j + 1 in the high
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
      if (High) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
      }
      const __m256i scale0 = _mm256_shuffle_epi8(scales, pick[2 * j]);
      const __m256i scale1 = _mm256_shuffle_epi8(scales, pick[2 * j + 1]);
      for (int m = 0; m < R; ++m) {
        const int8_t* a = x.q[m] + s * kSuper + 64 * j;
        const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
        const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32));
#if defined(__AVX512VNNI__)
        isum[m] = _mm256_dpwssd_epi32(isum[m], _mm256_maddubs_epi16(lo, a0), scale0);
        isum[m] = _mm256_dpwssd_epi32(isum[m], _mm256_maddubs_epi16(hi, a1), scale1);
#else
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), scale0);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), scale1);
        isum[m] = _mm256_add_epi32(isum[m], _mm256_add_epi32(p0, p1));
#endif
      }
    }
    if constexpr (R == 1) {
      add_k4_super_block(d_half, x.d[0][s], isum[0], mins[0], one_row);
    } else {
      alignas(16) float dd[4];  // d, dmin
      _mm_store_ps(dd, d_half);
      acc.add(dd[0], x, s, isum);
      mins_acc.add(dd[1], x, s, mins);
    }
  }
  if constexpr (R == 1) {
    alignas(16) float sums[4];
    _mm_store_ps(sums, one_row);
    y[0] = sums[0] - sums[1];
  } else {
    acc.store(y, stride, &mins_acc);
  }
#else
  (void)stop;
  for (int m = 0; m < R; ++m) {
    float total = 0.f, mins_total = 0.f;
    for (int64_t s = 0; s < supers; ++s) {
      const uint8_t* b = row + s * kBytes;
      const int8_t* a = x.q[m] + s * kSuper;
      int32_t isum = 0, msum = 0;
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        kiln_cpu::k4_scale_min(j, b + 4, &sc, &mn);
        int32_t dot = 0;
        for (int i = 32 * j; i < 32 * j + 32; ++i) dot += kiln_cpu::k4_quant<High>(b, i) * a[i];
        isum += sc * dot;
        msum += mn * x.sums32[m][8 * s + j];
      }
      kiln_cpu::add_super_block(fp16_at(b) * x.d[m][s], isum, total);
      kiln_cpu::add_super_block(fp16_at(b + 2) * x.d[m][s], msum, mins_total);
    }
    y[m * stride] = total - mins_total;
  }
#endif
}

// One Q6_K row times R rows of x (as k4_rows). Per half (128 weights): ql 64 bytes, qh 32, 8 scales;
// weight l + 32 t (t = 0..3) is ql[l + 32 (t & 1)]'s low (t < 2) or high nibble with bits 2t, 2t + 1 of
// qh[l] above it, less 32, its scale 2t + l / 16. `stop`: the end of the rows this task reads
// (prefetches stay before it; `row` itself for no prefetching).
template <int R>
void q6_k_rows(const XRows<R>& x, const uint8_t* row, int64_t supers, const uint8_t* stop, float* y,
               int64_t stride) {
  constexpr int64_t kBytes = 210;
#if defined(KILN_FLOAT_LANES)
  const __m256i pick[4] = {repeat16(0, 1), repeat16(2, 3), repeat16(4, 5), repeat16(6, 7)};
  RowSums<R> acc;
  float one_row = 0.f;  // R = 1
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* b = row + s * kBytes;
    kiln_cpu::prefetch_kquant_ahead(b, kBytes, stop);
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    __m256i isum[R];
    for (int m = 0; m < R; ++m) {
      // the offset, 32 sum_j sc_j sum16_j, subtracted
      const __m256i offset =
          _mm256_madd_epi16(scales, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums16[m] + 16 * s)));
      isum[m] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
    }
    for (int h = 0; h < 2; ++h) {
      // this half's 8 scales in both lanes
      const __m256i half_scales = h ? _mm256_permute2x128_si256(scales, scales, 0x11)
                                    : _mm256_permute2x128_si256(scales, scales, 0x00);
      __m256i quants[4];  // weights 128 h + 32 t, 0..63
      kiln_cpu::q6_k_half(b, h, quants);
      for (int t = 0; t < 4; ++t) {
        const __m256i q = quants[t];
        const __m256i scale = _mm256_shuffle_epi8(half_scales, pick[t]);
        for (int m = 0; m < R; ++m) {
          const int8_t* a = x.q[m] + s * kSuper + 128 * h + 32 * t;
          const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
#if defined(__AVX512VNNI__)
          isum[m] = _mm256_dpwssd_epi32(isum[m], _mm256_maddubs_epi16(q, qx), scale);
#else
          isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q, qx), scale));
#endif
        }
      }
    }
    const float d = fp16_at(b + 208);
    if constexpr (R == 1) {
      kiln_cpu::add_super_block(d * x.d[0][s], kiln_cpu::hsum_epi32(isum[0]), one_row);
    } else {
      acc.add(d, x, s, isum);
    }
  }
  if constexpr (R == 1) {
    y[0] = one_row;
  } else {
    acc.store(y, stride);
  }
#else
  (void)stop;
  for (int m = 0; m < R; ++m) {
    float total = 0.f;
    for (int64_t s = 0; s < supers; ++s) {
      const uint8_t* b = row + s * kBytes;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const int8_t* a = x.q[m] + s * kSuper;
      int32_t isum = 0;
      for (int i = 0; i < 256; ++i) isum += sc[i / 16] * kiln_cpu::q6_k_quant(b, i) * a[i];
      kiln_cpu::add_super_block(fp16_at(b + 208) * x.d[m][s], isum, total);
    }
    y[m * stride] = total;
  }
#endif
}

// y[m0 .. m0 + R - 1, begin .. end - 1]: rows [begin, end) of W times x rows [m0, m0 + R)
template <int R>
void run_group(const Q8K& xq, int64_t m0, const kiln_cpu::KQuantParts& parts, const uint8_t* bp, int64_t begin,
               int64_t end, float* yp, int64_t n) {
  XRows<R> x;
  for (int m = 0; m < R; ++m) {
    x.q[m] = xq.q.data() + (m0 + m) * xq.k;
    x.d[m] = xq.d.data() + (m0 + m) * xq.supers;
    x.sums16[m] = xq.sums16.data() + (m0 + m) * (xq.k / 16);
    x.sums32[m] = xq.sums32.data() + (m0 + m) * (xq.k / 32);
  }
  int64_t i = 0;
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = kiln_cpu::kquant_row(parts, bp, xq.supers, r, i);
    const int64_t row_bytes = xq.supers * kiln_cpu::gguf_block(parts.types[i]).bytes;
    float* y = yp + m0 * n + r;
    // prefetch on the first group only: the later ones find the task's rows in the caches
    const int64_t last = std::min(end, parts.first_row[i + 1]);
    const uint8_t* stop = m0 == 0 ? row + (last - r) * row_bytes : row;
    if (parts.types[i] == kGgmlQ4K) {
      k4_rows<false, R>(x, row, xq.supers, stop, y, n);
    } else if (parts.types[i] == kGgmlQ5K) {
      k4_rows<true, R>(x, row, xq.supers, stop, y, n);
    } else {
      q6_k_rows<R>(x, row, xq.supers, stop, y, n);
    }
  }
}

at::Tensor run_kquants_a8(const char* op, const at::Tensor& x, int64_t rows, const at::Tensor& blocks,
                          const at::Tensor& parts, int64_t n) {
  kiln_cpu::check_activation(op, x, rows, kSuper);
  const int64_t k = x.size(1);
  const kiln_cpu::KQuantParts table = kiln_cpu::read_kquant_parts(op, parts, k / kSuper, blocks, n);
  const at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
  const int64_t m = x.size(0);
  Q8K xq(m, k);
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) xq.quantize(r, xp + r * k);
  });
  at::Tensor y = at::empty({m, n}, x.options());
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // weight rows [begin, end) by the row kernels: x rows in groups of kGroup, each group over those weight
  // rows (they stay in the caches)
  const auto row_kernels = [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += kGroup) {
      switch (std::min<int64_t>(kGroup, m - m0)) {
        case 1: run_group<1>(xq, m0, table, bp, begin, end, yp, n); break;
        case 2: run_group<2>(xq, m0, table, bp, begin, end, yp, n); break;
        case 3: run_group<3>(xq, m0, table, bp, begin, end, yp, n); break;
        case 4: run_group<4>(xq, m0, table, bp, begin, end, yp, n); break;
#if defined(CPU_CAPABILITY_AVX512)
        case 5: run_group<5>(xq, m0, table, bp, begin, end, yp, n); break;
        case 6: run_group<6>(xq, m0, table, bp, begin, end, yp, n); break;
        case 7: run_group<7>(xq, m0, table, bp, begin, end, yp, n); break;
        default: run_group<8>(xq, m0, table, bp, begin, end, yp, n); break;
#else
        default: break;  // kGroup = 4
#endif
      }
    }
  };
  if (m >= kAmxRows && kiln_cpu::kquants_a8_amx_usable()) {
    // each part's whole 16-row blocks on AMX tiles, the rows past its last one by the row kernels
    const kiln_cpu::Q8KTiles tiles(kiln_cpu::Q8KRows{xq.q.data(), xq.d.data(), xq.sums32.data(), m, k});
    std::vector<std::array<int64_t, 3>> units;  // first row, rows, part (-1: row kernels)
    for (size_t p = 0; p + 1 < table.first_row.size(); ++p) {
      int64_t r = table.first_row[p];
      for (; r + 16 <= table.first_row[p + 1]; r += 16) units.push_back({r, 16, static_cast<int64_t>(p)});
      if (r < table.first_row[p + 1]) units.push_back({r, table.first_row[p + 1] - r, -1});
    }
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const auto [first, rows, part] = units[u];
        if (part < 0) {
          row_kernels(first, first + rows);
          continue;
        }
        const int64_t row_bytes = xq.supers * kiln_cpu::gguf_block(table.types[part]).bytes;
        const uint8_t* row = bp + table.first_byte[part] + (first - table.first_row[part]) * row_bytes;
        kiln_cpu::kquants_a8_amx_rows(tiles, table.types[part], row, row_bytes, yp, n, first);
      }
    });
    return y;
  }
  at::parallel_for(0, n, kRowsPerTask, row_kernels);
  return y;
}

}  // namespace

namespace kiln_cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8_k(const at::Tensor& x) {
  kiln_cpu::check_activation("quantize_q8_k", x, -1, kSuper);
  const at::Tensor xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, k / kSuper}, x.options());
  at::Tensor sums = at::empty({m, k / 16}, x.options().dtype(at::kShort));
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int16_t* sp = sums.data_ptr<int16_t>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> sums32(k / 32);
    for (int64_t r = begin; r < end; ++r) {
      quantize_row(xp + r * k, k, qp + r * k, dp + r * (k / kSuper), sp + r * (k / 16), sums32.data());
    }
  });
  return {q, d, sums};
}

at::Tensor kquants_a8_gemm(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, int64_t n) {
  return run_kquants_a8("kquants_a8_gemm", x, -1, blocks, parts, n);
}

at::Tensor kquants_a8_gemv(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, int64_t n) {
  return run_kquants_a8("kquants_a8_gemv", x, 1, blocks, parts, n);
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("quantize_q8_k(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("kquants_a8_gemv(Tensor x, Tensor blocks, Tensor parts, int n) -> Tensor");
  m.def("kquants_a8_gemm(Tensor x, Tensor blocks, Tensor parts, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("quantize_q8_k", &kiln_cpu::quantize_q8_k);
  m.impl("kquants_a8_gemv", &kiln_cpu::kquants_a8_gemv);
  m.impl("kquants_a8_gemm", &kiln_cpu::kquants_a8_gemm);
}
