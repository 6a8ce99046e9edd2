// GGUF K-quant matrices (Q4_K, Q5_K, Q6_K) as their files store them, for the native kernels that read
// them in place: the parts table of a weight made of one or more such matrices stacked by rows (a fused
// QKV), and a super-block's 256 weights unpacked to small integers with a float32 scale (and offset)
// per sub-block, from which each weight's float32 value is one fma or product, exactly ggml's decode
// (gguf.quants):
//
//   Q4_K / Q5_K  w = (d sc_j) q - (dmin m_j)   q 0..15 / 0..31, sc_j and m_j 6-bit, per 32 weights:
//                the product (d sc_j) q is exact in float32 (at most 22 significant bits), so
//                fma(q, d sc_j, -(dmin m_j)) rounds once, as the subtraction does
//   Q6_K         w = (d sc_j) (q - 32)         sc_j int8 per 16: exact (at most 23 significant bits),
//                (q - 32) * (d sc_j)
//
// Shared by cpu_kquants_a8.cpp (the parts table, the prefetch), cpu_kquants_a8_amx.cpp (the quants),
// cpu_kquants.cpp (the exact row kernel) and cpu_blocks_panel.cpp (the exact many-row kernel).
#pragma once

#include <ATen/ATen.h>

#include "cpu_float_lanes.h"
#include "cpu_gguf_fields.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace kiln_cpu {

constexpr int64_t kKQuantSuper = 256;  // weights per K-quant super-block
// Software prefetch this far ahead of the super-block being read, once per 64-byte line (as
// cpu_q4_blocks.cpp: a matrix is too short a stream for the hardware prefetcher to reach full speed)
constexpr int64_t kKQuantPrefetchAhead = 4096;

// Prefetch super-block b's `bytes` bytes kKQuantPrefetchAhead ahead, not past `stop` (the end of the
// rows the task reads: none where stop <= b + kKQuantPrefetchAhead)
inline void prefetch_kquant_ahead(const uint8_t* b, int64_t bytes, const uint8_t* stop) {
  for (const uint8_t* p = b + kKQuantPrefetchAhead; p < b + kKQuantPrefetchAhead + bytes && p < stop; p += 64) {
    __builtin_prefetch(p, 0, 3);
  }
}

// A weight's parts, read and checked: per part its GGML type, first output row and first byte
struct KQuantParts {
  std::vector<int64_t> types, first_row, first_byte;
};

// parts int64 [P, 2] (GGML type, rows) for blocks uint8 [bytes] whose rows hold `supers` super-blocks
// each and n output rows in all; errors name `op`
inline KQuantParts read_kquant_parts(const char* op, const at::Tensor& parts, int64_t supers,
                                     const at::Tensor& blocks, int64_t n) {
  TORCH_CHECK(parts.device().is_cpu() && parts.scalar_type() == at::kLong && parts.dim() == 2 && parts.size(1) == 2 &&
                  parts.size(0) >= 1,
              op, ": parts must be int64 [P, 2] (GGML type, rows) on the CPU, P >= 1, got ", parts.scalar_type(), " ",
              parts.sizes(), " on ", parts.device());
  const at::Tensor pc = parts.contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  const int64_t count = parts.size(0);
  KQuantParts out{std::vector<int64_t>(count), std::vector<int64_t>(count + 1, 0),
                  std::vector<int64_t>(count + 1, 0)};
  for (int64_t i = 0; i < count; ++i) {
    out.types[i] = pp[2 * i];
    TORCH_CHECK(out.types[i] == kGgmlQ4K || out.types[i] == kGgmlQ5K || out.types[i] == kGgmlQ6K, op, ": part ", i,
                " has GGML type ", out.types[i], "; the kernel takes Q4_K (12), Q5_K (13) and Q6_K (14)");
    TORCH_CHECK(pp[2 * i + 1] >= 0, op, ": part ", i, " has ", pp[2 * i + 1], " rows");
    out.first_row[i + 1] = out.first_row[i] + pp[2 * i + 1];
    out.first_byte[i + 1] = out.first_byte[i] + pp[2 * i + 1] * supers * gguf_block(out.types[i]).bytes;
  }
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 1 &&
                  blocks.numel() == out.first_byte[count],
              op, ": blocks must be uint8 [", out.first_byte[count], "] on the CPU (the parts' rows of K = ",
              supers * kKQuantSuper, ", as their files store them), got ", blocks.scalar_type(), " ", blocks.sizes(),
              " on ", blocks.device());
  TORCH_CHECK(n == out.first_row[count], op, ": n = ", n, " but the parts hold ", out.first_row[count], " rows");
  return out;
}

// The checks both exact K-quant ops share: x float32 [M, K] on the CPU, K a positive multiple of 256,
// and the parts table for it (read_kquant_parts); errors name `op`
inline KQuantParts check_kquant_args(const char* op, const at::Tensor& x, const at::Tensor& blocks,
                                     const at::Tensor& parts, int64_t n) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU, got ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, op, ": x must be float32 [M, K], got ", x.scalar_type(),
              " ", x.sizes());
  const int64_t k = x.size(1);
  TORCH_CHECK(k > 0 && k % kKQuantSuper == 0, op, ": K = ", k, " must be a positive multiple of 256");
  return read_kquant_parts(op, parts, k / kKQuantSuper, blocks, n);
}

// Output row r's part (`part`: a hint, the previous row's, moved forward as needed) and its bytes
inline const uint8_t* kquant_row(const KQuantParts& parts, const uint8_t* blocks, int64_t supers, int64_t r,
                                 int64_t& part) {
  while (r >= parts.first_row[part + 1]) ++part;
  while (r < parts.first_row[part]) --part;
  const int64_t row_bytes = supers * gguf_block(parts.types[part]).bytes;
  return blocks + parts.first_byte[part] + (r - parts.first_row[part]) * row_bytes;
}

// Q4_K / Q5_K's 12 scale bytes -> the eight 6-bit scales (sc) and mins (m) as bytes, four to a word, as
// ggml's get_scale_min_k4: bytes 0-3 hold sc 0-3 and the top bits of sc 4-7, bytes 4-7 the same for m,
// bytes 8-11 the low four bits of sc 4-7 (low nibbles) and of m 4-7 (high nibbles)
inline void k4_scales(const uint8_t* s, uint32_t* sc, uint32_t* m) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  sc[0] = u[0] & 0x3f3f3f3fu;
  m[0] = u[1] & 0x3f3f3f3fu;
  sc[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
  m[1] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
}

#if defined(KILN_FLOAT_LANES)
// Q4_K / Q5_K super-block b's scales d sc_j and offsets -(dmin m_j), float32 [8] each (aligned to 32)
inline void k4_scale_offset(const uint8_t* b, float* scale, float* offset) {
  uint32_t sc[2], mn[2];
  k4_scales(b + 4, sc, mn);
  int32_t d_dmin;
  std::memcpy(&d_dmin, b, 4);
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(d_dmin));  // d, dmin
  const __m128i bytes = _mm_set_epi32(mn[1], mn[0], sc[1], sc[0]);
  const __m256 scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
  _mm256_store_ps(scale, _mm256_mul_ps(_mm256_set1_ps(_mm_cvtss_f32(dd)), scales));
  const __m256 dmin = _mm256_set1_ps(_mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 0x55)));
  _mm256_store_ps(offset, _mm256_xor_ps(_mm256_set1_ps(-0.f), _mm256_mul_ps(dmin, mins)));  // -(dmin m)
}
#endif

// A super-block's 256 quants as int8: in vector builds eight AVX2 registers (q[j]: weights 32 j ..
// 32 j + 31), so that no kernel stores and reloads them; else an array
#if defined(KILN_FLOAT_LANES)
using Quants = __m256i[8];
#else
using Quants = int8_t[kKQuantSuper];
#endif

#if defined(KILN_FLOAT_LANES)
// Super-block b of Q4_K (High false) or Q5_K (High true) -> its quants 0..15 / 0..31, q[j] weights 32 j ..
// 32 j + 31 (unpack_k4; cpu_kquants_a8_amx.cpp)
template <bool High>
inline void k4_quants(const uint8_t* b, __m256i (&q)[8]) {
  // 32 nibble bytes a step: sub-block 2j in their low nibbles, 2j + 1 in their high ones; Q5_K's bit j
  // of qh[l] is weight l of sub-block j's fifth bit
  const uint8_t* qs = b + (High ? 48 : 16);
  const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  const __m256i qh = High ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if (High) {
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
    }
    q[2 * j] = lo;
    q[2 * j + 1] = hi;
  }
}
#endif

// Super-block b of Q4_K (High false) or Q5_K (High true) -> q (its quants: 0..15 / 0..31)
// and per sub-block of 32 weights a float32 scale d sc_j and offset -(dmin m_j) [8] each (aligned to 32):
// weight i is fma(q[i], scale[i / 32], offset[i / 32]), exactly (the header's table)
template <bool High>
inline void unpack_k4(const uint8_t* b, Quants& q, float* scale, float* offset) {
#if defined(KILN_FLOAT_LANES)
  k4_scale_offset(b, scale, offset);
  k4_quants<High>(b, q);
#else
  uint32_t sc[2], mn[2];
  k4_scales(b + 4, sc, mn);
  const float d = fp16_at(b), dmin = fp16_at(b + 2);
  for (int j = 0; j < 8; ++j) {
    const int s = static_cast<int>((sc[j / 4] >> (8 * (j % 4))) & 0xff);
    const int m = static_cast<int>((mn[j / 4] >> (8 * (j % 4))) & 0xff);
    scale[j] = d * static_cast<float>(s);
    offset[j] = -(dmin * static_cast<float>(m));
  }
  for (int i = 0; i < 256; ++i) q[i] = static_cast<int8_t>(k4_quant<High>(b, i));
#endif
}

#if defined(KILN_FLOAT_LANES)
// Half h (weights 128 h .. 128 h + 127) of Q6_K super-block b: q[t] the quants 0..63 of weights
// 128 h + 32 t .. + 31. Weight l + 32 t is ql[l + 32 (t & 1)]'s low (t < 2) or high nibble with bits 2t,
// 2t + 1 of qh[l] above it.
inline void q6_k_half(const uint8_t* b, int h, __m256i (&q)[4]) {
  const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
  const uint8_t* ql = b + 64 * h;
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i nibbles[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
  for (int t = 0; t < 4; ++t) {
    q[t] = _mm256_or_si256(nibbles[t], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), two), 4));
  }
}
#endif

// Super-block b of Q6_K -> q (q - 32) and per 16 weights a float32 scale d sc_j [16]: weight i is
// q[i] * scale[i / 16], exactly
inline void unpack_q6_k(const uint8_t* b, Quants& q, float* scale) {
#if defined(KILN_FLOAT_LANES)
  uint16_t d_bits;
  std::memcpy(&d_bits, b + 208, 2);
  const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d_bits))));
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  _mm256_storeu_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
  _mm256_storeu_ps(scale + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
  const __m256i bias = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    __m256i half[4];
    q6_k_half(b, h, half);
    for (int t = 0; t < 4; ++t) q[4 * h + t] = _mm256_sub_epi8(half[t], bias);
  }
#else
  const float d = fp16_at(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(sc[j]);
  for (int i = 0; i < 256; ++i) q[i] = static_cast<int8_t>(q6_k_quant(b, i));
#endif
}

// The K-quant types, for kernels specialized on each
enum class KQuant { kQ4K, kQ5K, kQ6K };

// One super-block unpacked: quants and scales as unpack_k4 / unpack_q6_k give them (offset: Q4_K /
// Q5_K only)
struct KQuantUnpacked {
  Quants q;
  alignas(64) float scale[16];
  alignas(64) float offset[8];
};

template <KQuant T>
inline void unpack(const uint8_t* b, KQuantUnpacked& u) {
  if constexpr (T == KQuant::kQ6K) {
    unpack_q6_k(b, u.q, u.scale);
  } else {
    unpack_k4<T == KQuant::kQ5K>(b, u.q, u.scale, u.offset);
  }
}

#if !defined(KILN_FLOAT_LANES)
// Weight i of an unpacked super-block, its float32 value
template <KQuant T>
inline float weight(const KQuantUnpacked& u, int i) {
  if constexpr (T == KQuant::kQ6K) {
    return static_cast<float>(u.q[i]) * u.scale[i / 16];
  } else {
    return std::fma(static_cast<float>(u.q[i]), u.scale[i / 32], u.offset[i / 32]);
  }
}
#endif

#if defined(KILN_FLOAT_LANES)
// Weights [v kLanes, (v + 1) kLanes) of an unpacked super-block as a vector of floats
template <KQuant T>
inline lanes::Floats weights(const KQuantUnpacked& u, int v) {
  using namespace lanes;
  const __m256i chunk = u.q[v * kLanes / 32];
  const int at = v * kLanes % 32;  // the piece's first byte in its register
  const __m128i half = at < 16 ? _mm256_castsi256_si128(chunk) : _mm256_extracti128_si256(chunk, 1);
#if defined(CPU_CAPABILITY_AVX512)
  const Floats q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half));
#else
  const Floats q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(at % 16 ? _mm_srli_si128(half, 8) : half));
#endif
  if constexpr (T == KQuant::kQ6K) {
    return mul(q, set1(u.scale[v * kLanes / 16]));
  } else {
    return fmadd(q, set1(u.scale[v * kLanes / 32]), set1(u.offset[v * kLanes / 32]));
  }
}
#endif

// f(std::integral_constant<KQuant, T>{}) for GGML type id `type` (a parts table's: checked there)
template <typename F>
inline void with_kquant(int64_t type, F&& f) {
  if (type == kGgmlQ4K) {
    f(std::integral_constant<KQuant, KQuant::kQ4K>{});
  } else if (type == kGgmlQ5K) {
    f(std::integral_constant<KQuant, KQuant::kQ5K>{});
  } else {
    f(std::integral_constant<KQuant, KQuant::kQ6K>{});
  }
}

#if !defined(KILN_FLOAT_LANES)
// Output row r of `parts`' blocks as its K = supers * 256 float32 weights, w (the scalar builds' kernels)
inline void kquant_row_weights(const KQuantParts& parts, const uint8_t* blocks, int64_t supers, int64_t r,
                               float* w) {
  int64_t part = 0;
  const uint8_t* row = kquant_row(parts, blocks, supers, r, part);
  const int64_t bytes = gguf_block(parts.types[part]).bytes;
  KQuantUnpacked u;
  with_kquant(parts.types[part], [&](auto t) {
    for (int64_t s = 0; s < supers; ++s) {
      unpack<decltype(t)::value>(row + s * bytes, u);
      for (int i = 0; i < kKQuantSuper; ++i) w[s * kKQuantSuper + i] = weight<decltype(t)::value>(u, i);
    }
  });
}
#endif

}  // namespace kiln_cpu
