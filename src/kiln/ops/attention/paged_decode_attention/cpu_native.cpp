// Paged decode attention for CPU: one query token per sequence against its paged KV cache.
//
// Registered as torch.ops.kiln_cpu.paged_decode (built and loaded by kiln/ops/native_cpu.py with the
// other native CPU kernels; cpu_native.py gives the op its fake implementation so compiled graphs can
// hold it). One work item is one (sequence,
// KV head): its G = H / Hkv query heads share every key and value row it loads. Per item: scores of
// the visible positions (each key row converted to float32 once, dotted with the G queries), a
// float32 softmax, then the value rows accumulated into G float32 rows. Positions at or past a
// sequence's length are never read, so whatever the cache holds there (NaN included) cannot leak in.
//
// Vectorized with ATen's at::vec (AVX-512 / AVX2 as ATen's CPU capability on the host: kiln/ops/native_cpu.py).
// The K pass prefetches the rows both passes read (kPrefetchPositions ahead).
//
// kiln_cpu.paged_decode_fp8 reads a float8_e4m3fn cache the same way: its per-head key scale is folded
// into the queries and its value scale into the output, so the loops see the stored e4m3 values,
// converted to float32 a vector at a time (exactly). With exact caches (float16, in the fp8 cache's
// units: paged_decode_attention/spec.py) a sequence's first block and its last exact_window positions
// come from there: the visible positions split into at most three runs (first block, fp8 middle,
// window), each walked with its own row source, so no position pays a per-row branch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "native_cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <optional>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline Vec load_f32(const T* p);
template <>
inline Vec load_f32<float>(const float* p) {
  return Vec::loadu(p);
}
template <>
inline Vec load_f32<c10::BFloat16>(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_fp32_from_bf16(p, v);
  return v;
}
template <>
inline Vec load_f32<c10::Half>(const c10::Half* p) {
  Vec v;
  at::vec::load_fp32_from_fp16(p, v);
  return v;
}

// float8_e4m3fn -> float32, exactly: the 7 magnitude bits shifted into a float32's exponent and mantissa
// give the value times 2^-120 (normal or subnormal e4m3 alike, the latter as float32 denormals), the
// sign goes to bit 31, then one multiply by 2^120; e4m3fn's NaN (magnitude 0x7F) is set apart.
template <>
inline Vec load_f32<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(magnitude, 20),
                                       _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24));
  const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7F));
  return _mm512_mask_mov_ps(value, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(magnitude, 20),
                                       _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24));
  const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7F)));
  return _mm256_blendv_ps(value, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
#else
  float values[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) values[i] = static_cast<float>(p[i]);
  return Vec::loadu(values);
#endif
}

// Prefetch distance in positions: the K pass asks for the key and value rows this far ahead (and for the
// first ones before it starts), so the V pass finds its rows in cache. Rows of one (sequence, KV head) are
// strided and split across blocks, which the hardware prefetchers follow poorly. 2-core Zen 5, 30
// layers' caches, 16 sequences, cache-cold (scripts/cpu_paged_decode_cold.py): at ~96 positions float32
// 1.22x (26.8 -> 32.6 GB/s), bfloat16 1.35x (19.7 -> 26.5); at ~400 1.14x and 1.69x; 16 beat 4 and 8.
constexpr int64_t kPrefetchPositions = 16;

template <typename T>
inline void prefetch_row(const T* row, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < elements * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(bytes + b, 0, 3);
}

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Where the key and value rows of a run of positions are: the cache through the sequence's block table,
// or (fp8 caches) the exact caches, the first block through exact_row[0] and later positions through
// the ring exact_row[1 + (pos / BS) % ring]. Offsets are in elements from the item's kv head.
template <typename TC>
struct PagedRows {
  const TC* keys;
  const TC* values;
  const int32_t* table;
  int64_t BS, token_stride, block_stride;
  inline int64_t offset(int64_t pos) const { return table[pos / BS] * block_stride + (pos % BS) * token_stride; }
};

struct ExactRows {
  const c10::Half* keys;
  const c10::Half* values;
  const int32_t* exact_row;
  int64_t ring, BS, token_stride, block_stride;
  inline int64_t offset(int64_t pos) const {
    const int64_t block = pos < BS ? exact_row[0] : exact_row[1 + (pos / BS) % ring];
    return block * block_stride + (pos % BS) * token_stride;
  }
};

// One item's visible positions [first, length): all from the cache, or with exact positions (EXACT)
// the first block's and the window's (from window_start = max(BS, length - W) on) from the exact caches.
template <typename TC>
struct ItemRows {
  PagedRows<TC> paged;
  ExactRows exact;
  int64_t first, length, window_start;

  template <bool EXACT, typename F>
  inline void for_runs(F&& run) const {
    if (!EXACT) {
      run(paged, first, length);
      return;
    }
    const int64_t BS = paged.BS;
    const int64_t middle = std::max(first, BS), end_middle = std::max(middle, window_start);
    if (first < BS) run(exact, first, std::min(length, BS));
    if (middle < end_middle) run(paged, middle, std::min(end_middle, length));
    if (end_middle < length) run(exact, end_middle, length);
  }
};

// One (sequence, KV head) item, for NV = D / Vec::size() vectors per row and GN query heads, both known
// at compile time so the G x NV accumulators stay in registers. scores: GN x n, position p at p - first.
template <int NV, int GN, bool EXACT, typename TC>
inline void attend(const float* queries, const ItemRows<TC>& item, float* scores, float* out) {
  constexpr int64_t V = Vec::size();
  const int64_t first = item.first, n = item.length - item.first;
  Vec q[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c) q[g][c] = Vec::loadu(queries + g * NV * V + c * V);
  item.template for_runs<EXACT>([&](const auto& rows, int64_t p0, int64_t p1) {
    // the prefetches written out in both loops: a shared lambda measured as slow as no prefetch at all
    for (int64_t pos = p0; pos < std::min(p1, p0 + kPrefetchPositions); ++pos) {
      prefetch_row(rows.keys + rows.offset(pos), NV * V);
      prefetch_row(rows.values + rows.offset(pos), NV * V);
    }
    for (int64_t pos = p0; pos < p1; ++pos) {
      const auto* k = rows.keys + rows.offset(pos);
      if (pos + kPrefetchPositions < p1) {
        const int64_t ahead = rows.offset(pos + kPrefetchPositions);
        prefetch_row(rows.keys + ahead, NV * V);
        prefetch_row(rows.values + ahead, NV * V);
      }
      Vec sums[GN];
      for (int g = 0; g < GN; ++g) sums[g] = Vec(0.f);
      for (int c = 0; c < NV; ++c) {
        const Vec kv = load_f32(k + c * V);
        for (int g = 0; g < GN; ++g) sums[g] = at::vec::fmadd(q[g][c], kv, sums[g]);
      }
      for (int g = 0; g < GN; ++g) scores[g * n + pos - first] = reduce_add(sums[g]);
    }
  });
  float inv_sum[GN];
  for (int g = 0; g < GN; ++g) {
    float* s = scores + g * n;
    const float m = at::vec::reduce_all<float>([](Vec& a, Vec& c) { return at::vec::maximum(a, c); }, s, n);
    at::vec::map([m](Vec x) { return (x - Vec(m)).exp(); }, s, s, n);
    inv_sum[g] = 1.f / at::vec::reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, s, n);
  }
  Vec acc[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = Vec(0.f);
  item.template for_runs<EXACT>([&](const auto& rows, int64_t p0, int64_t p1) {
    for (int64_t pos = p0; pos < p1; ++pos) {
      const auto* v = rows.values + rows.offset(pos);
      Vec p[GN];
      for (int g = 0; g < GN; ++g) p[g] = Vec(scores[g * n + pos - first]);
      for (int c = 0; c < NV; ++c) {
        const Vec vv = load_f32(v + c * V);
        for (int g = 0; g < GN; ++g) acc[g][c] = at::vec::fmadd(p[g], vv, acc[g][c]);
      }
    }
  });
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c) (acc[g][c] * Vec(inv_sum[g])).store(out + g * NV * V + c * V);
}

template <int NV, bool EXACT, typename TC>
inline void attend_heads(int64_t G, const float* queries, const ItemRows<TC>& item, float* scores, float* out) {
  constexpr int64_t D = NV * Vec::size();
  for (int64_t g0 = 0; g0 < G; g0 += 4) {  // query heads four at a time (16 accumulators at D = 64)
    const float* qg = queries + g0 * D;
    float* og = out + g0 * D;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: attend<NV, 1, EXACT>(qg, item, scores, og); break;
      case 2: attend<NV, 2, EXACT>(qg, item, scores, og); break;
      case 3: attend<NV, 3, EXACT>(qg, item, scores, og); break;
      default: attend<NV, 4, EXACT>(qg, item, scores, og); break;
    }
  }
}

// Head dims the kernel is instantiated for: multiples of the vector width up to 32 vectors (D = 16 ... 512
// with AVX-512), those of the models Kiln runs among them; others: nullptr, and the Python side keeps its
// PyTorch form.
template <bool EXACT, typename TC>
using AttendHeads = void (*)(int64_t, const float*, const ItemRows<TC>&, float*, float*);

template <bool EXACT, typename TC>
AttendHeads<EXACT, TC> attend_for(int64_t D) {
  constexpr int64_t V = Vec::size();
  if (D % V != 0) return nullptr;
  switch (D / V) {
    case 1: return &attend_heads<1, EXACT, TC>;  // the tests' tiny models (head_dim 16) on AVX-512
    case 2: return &attend_heads<2, EXACT, TC>;
    case 4: return &attend_heads<4, EXACT, TC>;
    case 5: return &attend_heads<5, EXACT, TC>;
    case 6: return &attend_heads<6, EXACT, TC>;
    case 8: return &attend_heads<8, EXACT, TC>;
    case 10: return &attend_heads<10, EXACT, TC>;
    case 12: return &attend_heads<12, EXACT, TC>;
    case 16: return &attend_heads<16, EXACT, TC>;
    case 32: return &attend_heads<32, EXACT, TC>;
    default: return nullptr;
  }
}

// What one call decodes: shapes, the caches' scales per kv head (fp8: stored = value / scale; null for a
// float cache) and the exact positions (null exact_k: none).
struct Problem {
  int64_t B, H, Hkv, D, BS, W, NB;
  float scale;
  int64_t window;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  const c10::Half* exact_k = nullptr;
  const c10::Half* exact_v = nullptr;
  const int32_t* exact_tables = nullptr;
  int64_t exact_width = 1, exact_blocks = 0, exact_window = 0;
};

template <bool EXACT, typename TQ, typename TC>
void decode(const TQ* q, const TC* kc, const TC* vc, const int32_t* tables, const int32_t* lens, TQ* out,
            const Problem& pb, std::atomic<bool>& failed, std::atomic<int64_t>& bad_block) {
  const int64_t B = pb.B, H = pb.H, Hkv = pb.Hkv, D = pb.D, BS = pb.BS, W = pb.W, NB = pb.NB;
  const int64_t G = H / Hkv;
  const int64_t token_stride = Hkv * D, block_stride = BS * Hkv * D;
  const AttendHeads<EXACT, TC> heads = attend_for<EXACT, TC>(D);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(G * D), scores, result(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t length = lens[b];
      const int64_t first = pb.window > 0 ? std::max<int64_t>(0, length - pb.window) : 0;
      const int64_t n = length - first;
      const int32_t* table = tables + b * W;
      for (int64_t i = first / BS; i * BS < length; ++i) {
        if (EXACT && (i == 0 || i * BS >= length - pb.exact_window)) continue;  // wholly read from the exact caches
        if (table[i] < 0 || table[i] >= NB) {
          bad_block.store(table[i]);
          failed.store(true);
          return;
        }
      }
      ItemRows<TC> rows{{kc + h * D, vc + h * D, table, BS, token_stride, block_stride}, {}, first, length, 0};
      if (EXACT) {
        const int32_t* exact_row = pb.exact_tables + b * pb.exact_width;
        for (int64_t c = 0; c < pb.exact_width; ++c) {
          if (exact_row[c] < 0 || exact_row[c] >= pb.exact_blocks) {
            bad_block.store(exact_row[c]);
            failed.store(true);
            return;
          }
        }
        const int64_t ring = std::max<int64_t>(pb.exact_width - 1, 1);  // width 1: the first block only
        rows.exact = {pb.exact_k + h * D, pb.exact_v + h * D, exact_row, ring, BS, token_stride, block_stride};
        rows.window_start = std::max<int64_t>(BS, length - pb.exact_window);
      }
      const TQ* qh = q + (b * H + h * G) * D;
      const float q_scale = pb.scale * (pb.k_scale ? pb.k_scale[h] : 1.f);
      for (int64_t i = 0; i < G * D; ++i) queries[i] = static_cast<float>(qh[i]) * q_scale;
      scores.resize(std::max<int64_t>(n, 1) * 4);
      if (n > 0) heads(G, queries.data(), rows, scores.data(), result.data());
      else std::fill(result.begin(), result.end(), 0.f);
      const float v_scale = pb.v_scale ? pb.v_scale[h] : 1.f;
      TQ* o = out + (b * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) o[i] = static_cast<TQ>(result[i] * v_scale);
    }
  });
}

// Whether paged_decode is instantiated for this head dim.
bool supports_head_dim(int64_t head_dim) { return attend_for<false, float>(head_dim) != nullptr; }

// float32, bfloat16 and float16 only: the dtypes load_f32 reads
#define KILN_FLOAT_CASES(...)                           \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)             \
  AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)          \
  AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)

Problem problem_of(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& tables, double scale,
                   int64_t window) {
  Problem pb;
  pb.B = q.size(0), pb.H = q.size(1), pb.D = q.size(2);
  pb.NB = kc.size(0), pb.BS = kc.size(1), pb.Hkv = kc.size(2), pb.W = tables.size(1);
  pb.scale = static_cast<float>(scale);
  pb.window = window;
  return pb;
}

void check_shapes(const char* op, const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, op, ": q [B, H, D], caches [N, BS, Hkv, D]");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), op, ": cache dtypes differ");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0, op, ": heads not a multiple of kv heads");
  TORCH_CHECK(supports_head_dim(q.size(2)), op, ": head_dim ", q.size(2), " is not built");
}

}  // namespace

namespace kiln_cpu {

// q [B, H, D]; key_cache / value_cache [num_blocks, block_size, Hkv, D] (float32, bfloat16 or float16,
// the same dtype); block_tables [B, W] and seq_lens [B] int32; window <= 0: no sliding window.
// Returns [B, H, D] in q's dtype. Shapes and dtypes are validated by the caller (kiln.ops); an entry
// of block_tables out of range within a sequence's length raises here instead of reading past the cache.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  check_shapes("kiln_cpu.paged_decode", q, key_cache, value_cache);
  auto qc = q.contiguous();
  auto kc = key_cache.contiguous();
  auto vc = value_cache.contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  auto lens = seq_lens.to(at::kInt).contiguous();
  auto out = at::empty_like(qc);
  const Problem pb = problem_of(qc, kc, tables, scale, window);
  std::atomic<bool> failed{false};
  std::atomic<int64_t> bad{0};
  AT_DISPATCH_SWITCH(qc.scalar_type(), "kiln_cpu_paged_decode_q", KILN_FLOAT_CASES([&] {
    using TQ = scalar_t;
    AT_DISPATCH_SWITCH(kc.scalar_type(), "kiln_cpu_paged_decode", KILN_FLOAT_CASES([&] {
      decode<false, TQ, scalar_t>(qc.data_ptr<TQ>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                                  tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<TQ>(), pb,
                                  failed, bad);
    }));
  }));
  TORCH_CHECK(!failed.load(), "kiln_cpu.paged_decode: block table entry ", bad.load(),
              " is out of range for a cache of ", key_cache.size(0), " blocks");
  return out;
}

// paged_decode over a float8_e4m3fn cache with k_scale / v_scale float32 [Hkv] (value = stored * scale)
// and, with exact_key_cache / exact_value_cache float16 [num_exact_blocks, block_size, Hkv, D] and
// exact_block_tables int32 [B, 1 + R], exact positions: a sequence's first block_size positions and its
// last exact_window ones are read from the exact caches (paged_decode_attention/spec.py). An exact block
// id out of range raises, as a block table entry does.
at::Tensor paged_decode_fp8(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            int64_t window, const at::Tensor& k_scale, const at::Tensor& v_scale,
                            const std::optional<at::Tensor>& exact_key_cache,
                            const std::optional<at::Tensor>& exact_value_cache,
                            const std::optional<at::Tensor>& exact_block_tables, int64_t exact_window) {
  check_shapes("kiln_cpu.paged_decode_fp8", q, key_cache, value_cache);
  TORCH_CHECK(key_cache.scalar_type() == at::kFloat8_e4m3fn, "kiln_cpu.paged_decode_fp8: the cache is not e4m3fn");
  const bool exact = exact_block_tables.has_value();
  auto qc = q.contiguous();
  auto kc = key_cache.contiguous();
  auto vc = value_cache.contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  auto lens = seq_lens.to(at::kInt).contiguous();
  auto ks = k_scale.to(at::kFloat).contiguous();
  auto vs = v_scale.to(at::kFloat).contiguous();
  auto out = at::empty_like(qc);
  Problem pb = problem_of(qc, kc, tables, scale, window);
  pb.k_scale = ks.data_ptr<float>();
  pb.v_scale = vs.data_ptr<float>();
  at::Tensor ekc, evc, etables;
  if (exact) {
    ekc = exact_key_cache.value().contiguous();
    evc = exact_value_cache.value().contiguous();
    etables = exact_block_tables.value().to(at::kInt).contiguous();
    TORCH_CHECK(ekc.scalar_type() == at::kHalf && evc.scalar_type() == at::kHalf,
                "kiln_cpu.paged_decode_fp8: exact caches are float16");
    pb.exact_k = reinterpret_cast<const c10::Half*>(ekc.data_ptr<at::Half>());
    pb.exact_v = reinterpret_cast<const c10::Half*>(evc.data_ptr<at::Half>());
    pb.exact_tables = etables.data_ptr<int32_t>();
    pb.exact_width = etables.size(1);
    pb.exact_blocks = ekc.size(0);
    pb.exact_window = exact_window;
  }
  std::atomic<bool> failed{false};
  std::atomic<int64_t> bad{0};
  using TC = c10::Float8_e4m3fn;
  AT_DISPATCH_SWITCH(qc.scalar_type(), "kiln_cpu_paged_decode_fp8", KILN_FLOAT_CASES([&] {
    const auto* kp = reinterpret_cast<const TC*>(kc.data_ptr());
    const auto* vp = reinterpret_cast<const TC*>(vc.data_ptr());
    if (exact)
      decode<true, scalar_t, TC>(qc.data_ptr<scalar_t>(), kp, vp, tables.data_ptr<int32_t>(),
                                 lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), pb, failed, bad);
    else
      decode<false, scalar_t, TC>(qc.data_ptr<scalar_t>(), kp, vp, tables.data_ptr<int32_t>(),
                                  lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), pb, failed, bad);
  }));
  TORCH_CHECK(!failed.load(), "kiln_cpu.paged_decode_fp8: block table or exact block table entry ", bad.load(),
              " is out of range");
  return out;
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window) -> Tensor");
  m.def(
      "paged_decode_fp8(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window, Tensor k_scale, Tensor v_scale, Tensor? exact_key_cache, "
      "Tensor? exact_value_cache, Tensor? exact_block_tables, int exact_window) -> Tensor");
  m.def("supports_head_dim(int head_dim) -> bool", &supports_head_dim);
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("paged_decode", &kiln_cpu::paged_decode);
  m.impl("paged_decode_fp8", &kiln_cpu::paged_decode_fp8);
}
