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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
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

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// One (sequence, KV head) item, for NV = D / Vec::size() vectors per row and GN query heads, both known
// at compile time so the G x NV accumulators stay in registers.
template <int NV, int GN, typename TC>
inline void attend(const float* queries, const TC* kc, const TC* vc, const int32_t* table, int64_t first,
                   int64_t n, int64_t BS, int64_t token_stride, int64_t block_stride, float* scores, float* out) {
  constexpr int64_t V = Vec::size();
  Vec q[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c) q[g][c] = Vec::loadu(queries + g * NV * V + c * V);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = first + j;
    const TC* k = kc + table[pos / BS] * block_stride + (pos % BS) * token_stride;
    Vec sums[GN];
    for (int g = 0; g < GN; ++g) sums[g] = Vec(0.f);
    for (int c = 0; c < NV; ++c) {
      const Vec kv = load_f32(k + c * V);
      for (int g = 0; g < GN; ++g) sums[g] = at::vec::fmadd(q[g][c], kv, sums[g]);
    }
    for (int g = 0; g < GN; ++g) scores[g * n + j] = reduce_add(sums[g]);
  }
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
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = first + j;
    const TC* v = vc + table[pos / BS] * block_stride + (pos % BS) * token_stride;
    Vec p[GN];
    for (int g = 0; g < GN; ++g) p[g] = Vec(scores[g * n + j]);
    for (int c = 0; c < NV; ++c) {
      const Vec vv = load_f32(v + c * V);
      for (int g = 0; g < GN; ++g) acc[g][c] = at::vec::fmadd(p[g], vv, acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c) (acc[g][c] * Vec(inv_sum[g])).store(out + g * NV * V + c * V);
}

template <int NV, typename TC>
inline void attend_heads(int64_t G, const float* queries, const TC* kc, const TC* vc, const int32_t* table,
                         int64_t first, int64_t n, int64_t BS, int64_t token_stride, int64_t block_stride,
                         float* scores, float* out) {
  constexpr int64_t D = NV * Vec::size();
  for (int64_t g0 = 0; g0 < G; g0 += 4) {  // query heads four at a time (16 accumulators at D = 64)
    const float* qg = queries + g0 * D;
    float* og = out + g0 * D;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: attend<NV, 1>(qg, kc, vc, table, first, n, BS, token_stride, block_stride, scores, og); break;
      case 2: attend<NV, 2>(qg, kc, vc, table, first, n, BS, token_stride, block_stride, scores, og); break;
      case 3: attend<NV, 3>(qg, kc, vc, table, first, n, BS, token_stride, block_stride, scores, og); break;
      default: attend<NV, 4>(qg, kc, vc, table, first, n, BS, token_stride, block_stride, scores, og); break;
    }
  }
}

// Head dims the kernel is instantiated for: multiples of the vector width up to 32 vectors (D = 32 ... 512
// with AVX-512), those of the models Kiln runs among them; others: nullptr, and the Python side keeps its
// PyTorch form.
template <typename TC>
using AttendHeads = void (*)(int64_t, const float*, const TC*, const TC*, const int32_t*, int64_t, int64_t,
                             int64_t, int64_t, int64_t, float*, float*);

template <typename TC>
AttendHeads<TC> attend_for(int64_t D) {
  constexpr int64_t V = Vec::size();
  if (D % V != 0) return nullptr;
  switch (D / V) {
    case 2: return &attend_heads<2, TC>;
    case 4: return &attend_heads<4, TC>;
    case 5: return &attend_heads<5, TC>;
    case 6: return &attend_heads<6, TC>;
    case 8: return &attend_heads<8, TC>;
    case 10: return &attend_heads<10, TC>;
    case 12: return &attend_heads<12, TC>;
    case 16: return &attend_heads<16, TC>;
    case 32: return &attend_heads<32, TC>;
    default: return nullptr;
  }
}

template <typename TQ, typename TC>
void decode(const TQ* q, const TC* kc, const TC* vc, const int32_t* tables, const int32_t* lens, TQ* out,
            const int64_t B, const int64_t H, const int64_t Hkv, const int64_t D, const int64_t BS, const int64_t W,
            const int64_t NB, const float scale, const int64_t window, std::atomic<bool>& failed,
            std::atomic<int64_t>& bad_block) {
  const int64_t G = H / Hkv;
  const int64_t token_stride = Hkv * D, block_stride = BS * Hkv * D;
  const AttendHeads<TC> heads = attend_for<TC>(D);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(G * D), scores, result(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t length = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t n = length - first;
      const int32_t* table = tables + b * W;
      for (int64_t i = first / BS; i * BS < length; ++i) {
        if (table[i] < 0 || table[i] >= NB) {
          bad_block.store(table[i]);
          failed.store(true);
          return;
        }
      }
      const TQ* qh = q + (b * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) queries[i] = static_cast<float>(qh[i]) * scale;
      scores.resize(std::max<int64_t>(n, 1) * 4);
      if (n > 0) heads(G, queries.data(), kc + h * D, vc + h * D, table, first, n, BS, token_stride, block_stride,
                       scores.data(), result.data());
      else std::fill(result.begin(), result.end(), 0.f);
      TQ* o = out + (b * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) o[i] = static_cast<TQ>(result[i]);
    }
  });
}

// Whether paged_decode is instantiated for this head dim.
bool supports_head_dim(int64_t head_dim) { return attend_for<float>(head_dim) != nullptr; }

// float32, bfloat16 and float16 only: the dtypes load_f32 reads
#define KILN_FLOAT_CASES(...)                           \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)             \
  AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)          \
  AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)

template <typename TQ>
void dispatch_cache(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                    const at::Tensor& lens, at::Tensor& out, float scale, int64_t window,
                    std::atomic<bool>& failed, std::atomic<int64_t>& bad) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = kc.size(0), BS = kc.size(1), Hkv = kc.size(2), W = tables.size(1);
  AT_DISPATCH_SWITCH(kc.scalar_type(), "kiln_cpu_paged_decode", KILN_FLOAT_CASES([&] {
    decode<TQ, scalar_t>(q.data_ptr<TQ>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                         tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<TQ>(), B, H, Hkv, D,
                         BS, W, NB, scale, window, failed, bad);
  }));
}

// q [B, H, D]; key_cache / value_cache [num_blocks, block_size, Hkv, D] (float32, bfloat16 or float16,
// the same dtype); block_tables [B, W] and seq_lens [B] int32; window <= 0: no sliding window.
// Returns [B, H, D] in q's dtype. Shapes and dtypes are validated by the caller (kiln.ops); an entry
// of block_tables out of range within a sequence's length raises here instead of reading past the cache.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "kiln_cpu.paged_decode: q [B, H, D], caches [N, BS, Hkv, D]");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "kiln_cpu.paged_decode: cache dtypes differ");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0, "kiln_cpu.paged_decode: heads not a multiple of kv heads");
  TORCH_CHECK(supports_head_dim(q.size(2)), "kiln_cpu.paged_decode: head_dim ", q.size(2), " is not built");
  auto qc = q.contiguous();
  auto kc = key_cache.contiguous();
  auto vc = value_cache.contiguous();
  auto tables = block_tables.to(at::kInt).contiguous();
  auto lens = seq_lens.to(at::kInt).contiguous();
  auto out = at::empty_like(qc);
  std::atomic<bool> failed{false};
  std::atomic<int64_t> bad{0};
  AT_DISPATCH_SWITCH(qc.scalar_type(), "kiln_cpu_paged_decode_q", KILN_FLOAT_CASES([&] {
    dispatch_cache<scalar_t>(qc, kc, vc, tables, lens, out, static_cast<float>(scale), window, failed, bad);
  }));
  TORCH_CHECK(!failed.load(), "kiln_cpu.paged_decode: block table entry ", bad.load(),
              " is out of range for a cache of ", key_cache.size(0), " blocks");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window) -> Tensor");
  m.def("supports_head_dim(int head_dim) -> bool", &supports_head_dim);
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
