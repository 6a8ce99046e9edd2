// The row kernel of the exact K-quant kernels (kiln.ops.gemm.cpu_kquants): y = x @ W^T in float32 with
// W one or more parts of GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) kept as the file stores them (0.56 /
// 0.69 / 0.82 bytes a weight), each weight its exact float32 value, ggml's decode
// (cpu_kquants_decode.h); x is not rounded.
//
//   Q4_K / Q5_K  factored per sub-block of 32, as cpu_q4_blocks.cpp's kernels:
//                y = sum_j (d sc_j) sum_i q_i x_i  -  sum_j (dmin m_j) sum_i x_i
//                (x's sums per 32 computed once a call; the second sum eight lanes a super-block)
//   Q6_K         one fma(q - 32, d sc_j) per weight (exact), then one FMA into each row's sums
//
// A row keeps kAcc accumulators (sub-block or vector j into j % kAcc), added pairwise at the end, so
// that one x row still has several FMA chains in flight. x rows run in groups of up to kGroup against
// each weight row (its blocks unpacked once a group; a Q6_K row past one group is decoded once into a
// float buffer the groups read, the same values and sums). Each (x row, weight row) pair takes the same
// operations in the same order whatever the call's row count, so a row's outputs are bit for bit those
// it gets alone (batch invariant). Many rows go to the panel kernel (cpu_blocks_panel.cpp). Registered
// as torch.ops.kiln_cpu.kquants_gemm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_float_lanes.h"
#include "cpu_kquants_decode.h"
#include "native_cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using kiln_cpu::kKQuantSuper, kiln_cpu::KQuant, kiln_cpu::KQuantUnpacked;
constexpr int64_t kRowsPerTask = 16;
constexpr int64_t kPrefetchAhead = 4096;  // as cpu_q4_blocks.cpp: this far ahead, once per 64-byte line

#if defined(KILN_FLOAT_LANES)
using namespace kiln_cpu::lanes;  // Floats: kLanes floats, 16 (AVX-512) or 8 (AVX2)
constexpr int kAcc = 4;           // accumulators per x row
constexpr int kPieces = kKQuantSuper / kLanes;
// x rows a pass: kGroup * kAcc accumulators stay in registers (32 AVX-512 registers, 16 AVX2 ones)
constexpr int kGroup = kLanes == 16 ? 4 : 2;

template <int R>
inline void finish(Floats (&acc)[R][kAcc], float* y, int64_t stride) {
  for (int r = 0; r < R; ++r) {
    y[r * stride] = sum(add(add(acc[r][0], acc[r][1]), add(acc[r][2], acc[r][3])));
  }
}

// R rows of x (x[r], K = supers * 256) times one weight row of type T at `row`, decoding as it goes;
// y[r * stride]. `stop`: prefetch no further (the row itself: none).
template <int R, KQuant T>
void rows_times_blocks(const float* const* x, const uint8_t* row, int64_t supers, const uint8_t* stop, float* y,
                       int64_t stride) {
  constexpr int64_t bytes = T == KQuant::kQ4K ? 144 : T == KQuant::kQ5K ? 176 : 210;
  Floats acc[R][kAcc];
  for (int r = 0; r < R; ++r) {
    for (int a = 0; a < kAcc; ++a) acc[r][a] = zero();
  }
  KQuantUnpacked u;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* b = row + s * bytes;
    for (const uint8_t* p = b + kPrefetchAhead; p < b + kPrefetchAhead + bytes && p < stop; p += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
    }
    kiln_cpu::unpack<T>(b, u);
#pragma GCC unroll 32
    for (int v = 0; v < kPieces; ++v) {
      const Floats w = kiln_cpu::weights<T>(u, v);
      for (int r = 0; r < R; ++r) {
        acc[r][v % kAcc] = fmadd(w, load(x[r] + s * kKQuantSuper + v * kLanes), acc[r][v % kAcc]);
      }
    }
  }
  finish<R>(acc, y, stride);
}

#if defined(CPU_CAPABILITY_AVX512)
// kLanes bytes at p: their low and high nibbles, with (Q5_K) bit `bit` and `bit + 1` of the bytes at qh
// above them as their fifth bits, as floats
template <bool High>
inline void k4_nibbles(const uint8_t* p, const uint8_t* qh, int bit, Floats& lo, Floats& hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m512i l = _mm512_and_si512(q, _mm512_set1_epi32(15)), h = _mm512_srli_epi32(q, 4);
  if (High) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh)));
    const __m512i one = _mm512_set1_epi32(1);
    l = _mm512_or_si512(l, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(b, bit), one), 4));
    h = _mm512_or_si512(h, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(b, bit + 1), one), 4));
  }
  lo = _mm512_cvtepi32_ps(l);
  hi = _mm512_cvtepi32_ps(h);
}
#else
template <bool High>
inline void k4_nibbles(const uint8_t* p, const uint8_t* qh, int bit, Floats& lo, Floats& hi) {
  const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m256i l = _mm256_and_si256(q, _mm256_set1_epi32(15)), h = _mm256_srli_epi32(q, 4);
  if (High) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qh)));
    const __m256i one = _mm256_set1_epi32(1);
    l = _mm256_or_si256(l, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(b, bit), one), 4));
    h = _mm256_or_si256(h, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(b, bit + 1), one), 4));
  }
  lo = _mm256_cvtepi32_ps(l);
  hi = _mm256_cvtepi32_ps(h);
}
#endif

// R rows of x times one Q4_K / Q5_K weight row, factored per sub-block of 32 as cpu_q4_blocks.cpp's:
// y = sum_j (d sc_j) sum_i q_i x_i - (dmin m_j) sum_i x_i, xsum[r] x row r's sums per 32
template <int R, bool High>
void rows_times_k4(const float* const* x, const float* const* xsum, const uint8_t* row, int64_t supers,
                   const uint8_t* stop, float* y, int64_t stride) {
  constexpr int64_t bytes = High ? 176 : 144;
  constexpr int kParts = 32 / kLanes;
  Floats acc[R][kAcc];
  __m256 macc[R];
  for (int r = 0; r < R; ++r) {
    for (int a = 0; a < kAcc; ++a) acc[r][a] = zero();
    macc[r] = _mm256_setzero_ps();
  }
  alignas(32) float scale[8], offset[8];
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* b = row + s * bytes;
    for (const uint8_t* p = b + kPrefetchAhead; p < b + kPrefetchAhead + bytes && p < stop; p += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
    }
    kiln_cpu::k4_scale_offset(b, scale, offset);
    const uint8_t* qs = b + (High ? 48 : 16);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      Floats tl[R], th[R];
      for (int r = 0; r < R; ++r) tl[r] = zero(), th[r] = zero();
#pragma GCC unroll 4
      for (int part = 0; part < kParts; ++part) {
        Floats lo, hi;
        k4_nibbles<High>(qs + 32 * c + part * kLanes, b + 16 + part * kLanes, 2 * c, lo, hi);
        for (int r = 0; r < R; ++r) {
          const float* xc = x[r] + s * kKQuantSuper + 64 * c + part * kLanes;
          tl[r] = fmadd(lo, load(xc), tl[r]);
          th[r] = fmadd(hi, load(xc + 32), th[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        acc[r][(2 * c) % kAcc] = fmadd(set1(scale[2 * c]), tl[r], acc[r][(2 * c) % kAcc]);
        acc[r][(2 * c + 1) % kAcc] = fmadd(set1(scale[2 * c + 1]), th[r], acc[r][(2 * c + 1) % kAcc]);
      }
    }
    for (int r = 0; r < R; ++r) {
      macc[r] = _mm256_fmadd_ps(_mm256_load_ps(offset), _mm256_loadu_ps(xsum[r] + 8 * s), macc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    y[r * stride] = sum(add(add(acc[r][0], acc[r][1]), add(acc[r][2], acc[r][3]))) + kiln_cpu::hsum(macc[r]);
  }
}

// The same sums from a weight row already decoded to floats (w [K])
template <int R>
void rows_times_floats(const float* const* x, const float* w, int64_t k, float* y, int64_t stride) {
  Floats acc[R][kAcc];
  for (int r = 0; r < R; ++r) {
    for (int a = 0; a < kAcc; ++a) acc[r][a] = zero();
  }
  for (int64_t i = 0; i < k; i += kPieces * kLanes) {
#pragma GCC unroll 32
    for (int v = 0; v < kPieces; ++v) {
      const Floats wv = load(w + i + v * kLanes);
      for (int r = 0; r < R; ++r) acc[r][v % kAcc] = fmadd(wv, load(x[r] + i + v * kLanes), acc[r][v % kAcc]);
    }
  }
  finish<R>(acc, y, stride);
}

// One weight row's float32 values: w [supers * 256], the same vectors rows_times_blocks computes
template <KQuant T>
void decode_row(const uint8_t* row, int64_t supers, float* w) {
  constexpr int64_t bytes = T == KQuant::kQ4K ? 144 : T == KQuant::kQ5K ? 176 : 210;
  KQuantUnpacked u;
  for (int64_t s = 0; s < supers; ++s) {
    kiln_cpu::unpack<T>(row + s * bytes, u);
    for (int v = 0; v < kPieces; ++v) store(w + s * kKQuantSuper + v * kLanes, kiln_cpu::weights<T>(u, v));
  }
}

template <int R>
void group_from_blocks(const float* x, const float* xsum, int64_t k, int64_t m0, const uint8_t* row, int64_t type,
                       int64_t supers, const uint8_t* stop, float* y, int64_t n) {
  const float* xr[R];
  const float* xs[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * k, xs[r] = xsum + (m0 + r) * (k / 32);
  if (type == kiln_cpu::kGgmlQ4K) return rows_times_k4<R, false>(xr, xs, row, supers, stop, y + m0 * n, n);
  if (type == kiln_cpu::kGgmlQ5K) return rows_times_k4<R, true>(xr, xs, row, supers, stop, y + m0 * n, n);
  rows_times_blocks<R, KQuant::kQ6K>(xr, row, supers, stop, y + m0 * n, n);
}

template <int R>
void group_from_floats(const float* x, int64_t k, int64_t m0, const float* w, float* y, int64_t n) {
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * k;
  rows_times_floats<R>(xr, w, k, y + m0 * n, n);
}

// x rows [0, m) times output rows [begin, end) of the weight: each weight row against every group of
// kGroup x rows in turn (the row stays in L1 / L2 for the later groups); a Q6_K row past one group is
// decoded once into a float buffer the groups read (the same values and sums)
void rows_kernel(const float* x, const float* xsum, int64_t m, int64_t k, const kiln_cpu::KQuantParts& parts,
                 const uint8_t* bp, int64_t begin, int64_t end, float* y, int64_t n) {
  const int64_t supers = k / kKQuantSuper;
  thread_local std::vector<float> w;
  int64_t part = 0;
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = kiln_cpu::kquant_row(parts, bp, supers, r, part);
    const int64_t type = parts.types[part];
    float* yr = y + r;
    if (type == kiln_cpu::kGgmlQ6K && m > kGroup) {
      if (w.size() < static_cast<size_t>(k)) w.resize(k);
      decode_row<KQuant::kQ6K>(row, supers, w.data());
      for (int64_t m0 = 0; m0 < m; m0 += kGroup) {
        switch (std::min<int64_t>(kGroup, m - m0)) {
          case 1: group_from_floats<1>(x, k, m0, w.data(), yr, n); break;
#if defined(CPU_CAPABILITY_AVX512)
          case 2: group_from_floats<2>(x, k, m0, w.data(), yr, n); break;
          case 3: group_from_floats<3>(x, k, m0, w.data(), yr, n); break;
          default: group_from_floats<4>(x, k, m0, w.data(), yr, n); break;
#else
          default: group_from_floats<2>(x, k, m0, w.data(), yr, n); break;
#endif
        }
      }
      continue;
    }
    // prefetch (Q6_K) on the first group only: the later ones find the row in the caches
    const int64_t last = std::min(end, parts.first_row[part + 1]);
    const uint8_t* stop = row + (last - r) * supers * kiln_cpu::gguf_block(type).bytes;
    for (int64_t m0 = 0; m0 < m; m0 += kGroup) {
      const uint8_t* ahead = m0 == 0 && type == kiln_cpu::kGgmlQ6K ? stop : row;
      switch (std::min<int64_t>(kGroup, m - m0)) {
        case 1: group_from_blocks<1>(x, xsum, k, m0, row, type, supers, ahead, yr, n); break;
#if defined(CPU_CAPABILITY_AVX512)
        case 2: group_from_blocks<2>(x, xsum, k, m0, row, type, supers, ahead, yr, n); break;
        case 3: group_from_blocks<3>(x, xsum, k, m0, row, type, supers, ahead, yr, n); break;
        default: group_from_blocks<4>(x, xsum, k, m0, row, type, supers, ahead, yr, n); break;
#else
        default: group_from_blocks<2>(x, xsum, k, m0, row, type, supers, ahead, yr, n); break;
#endif
      }
    }
  }
}
#else
// Scalar builds: the same weights, one float32 sum per output in k order (also batch invariant)
void rows_kernel(const float* x, const float* /*xsum*/, int64_t m, int64_t k, const kiln_cpu::KQuantParts& parts,
                 const uint8_t* bp, int64_t begin, int64_t end, float* y, int64_t n) {
  const int64_t supers = k / kKQuantSuper;
  std::vector<float> w(k);
  KQuantUnpacked u;
  int64_t part = 0;
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = kiln_cpu::kquant_row(parts, bp, supers, r, part);
    const int64_t bytes = kiln_cpu::gguf_block(parts.types[part]).bytes;
    kiln_cpu::with_kquant(parts.types[part], [&](auto t) {
      for (int64_t s = 0; s < supers; ++s) {
        kiln_cpu::unpack<decltype(t)::value>(row + s * bytes, u);
        for (int i = 0; i < kKQuantSuper; ++i) {
          w[s * kKQuantSuper + i] = kiln_cpu::weight<decltype(t)::value>(u, i);
        }
      }
    });
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
  const std::vector<float> xsum = block_sums(xp, m, k);
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    rows_kernel(xp, xsum.data(), m, k, table, bp, begin, end, yp, n);
  });
  return y;
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) { m.def("kquants_gemm(Tensor x, Tensor blocks, Tensor parts, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("kquants_gemm", &kiln_cpu::kquants_gemm); }
