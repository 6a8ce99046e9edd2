// Causal attention of one sequence on the CPU, float32: the prefill attention of
// paged_prefill_attention and flash_attention's CPU paths (kiln/ops/attention/cpu_sdpa.py).
//
//   out[i, h] = sum_j softmax_j(scale * q[i, h] . k[j, h / G]) v[j, h / G],  j in [lo_i, p_i]
//
// q [Lq, H, D], k / v [Lk, Hkv, D] (Lk >= Lq), G = H / Hkv. The queries are the last Lq positions of the
// sequence, so query i sits at p_i = Lk - Lq + i and sees the keys up to it (lo_i = 0, or with a sliding
// window W, p_i - W + 1). Keys past a query's position are never summed into its output.
//
// One work item is (kv head, block of query positions): its G query heads at those positions share the
// item's keys. Scores come from a register-tiled product of 4 query rows against 2 vectors of keys
// transposed once per kv head ([D, Lk]: a key vector is a load, a query element a broadcast); a float32
// softmax over each row's own keys; then P @ V, 4 rows against up to 4 vectors of the head dim at once,
// the keys all 4 rows see in one pass and each row's others alone. PyTorch's CPU flash kernel for SDPA
// ran SmolLM2's 270-token prefill attention (9 heads over 3, head_dim 64) at ~70 GFLOP/s on 2 Zen 5
// cores; this is what it was replaced with. Registered as torch.ops.kiln_cpu.causal_attention.
//
// Vectorized with ATen's at::vec (AVX-512 / AVX2 as ATen's CPU capability on the host:
// kiln/ops/native_cpu.py); head_dim must be a multiple of the vector width (causal_attention_head_dim).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "native_cpu_ops.h"

#include <algorithm>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int kRows = 4;                  // query rows per tile
constexpr int kKeyVecs = 2;               // key vectors per score tile
constexpr int kOutVecs = V == 16 ? 4 : 2;  // head-dim vectors per P @ V tile (16 / 8 accumulators)

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  int64_t Lq, Lk, H, Hkv, D, G;
  float scale;
  int64_t window;  // <= 0: none
  int64_t lo(int64_t p) const { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }
};

// One item's query rows: row r is query head h * G + r / n at position p0 + r % n (n positions).
struct Rows {
  int64_t h, i0, n;
  const Problem* pb;
  int64_t position(int64_t r) const { return pb->Lk - pb->Lq + i0 + r % n; }
  // row r's offset in q and out [Lq, H, D]
  int64_t offset(int64_t r) const { return ((i0 + r % n) * pb->H + h * pb->G + r / n) * pb->D; }
  const float* query(int64_t r) const { return pb->q + offset(r); }
  float* output(int64_t r) const { return pb->out + offset(r); }
};

// scores[r][c] = scale * q_r . k[klo + c] for RT rows from r0 and kKeyVecs * V columns from c0; kt: the
// kv head's keys transposed, [D][stride] (zero past Lk)
template <int RT>
inline void score_tile(const Rows& rows, int64_t r0, const float* kt, int64_t stride, int64_t klo, int64_t c0,
                       float* scores, int64_t width) {
  const int64_t D = rows.pb->D;
  const float* q[RT];
  for (int r = 0; r < RT; ++r) q[r] = rows.query(r0 + r);
  Vec acc[RT][kKeyVecs];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < kKeyVecs; ++c) acc[r][c] = Vec(0.f);
  const float* column = kt + klo + c0;
  for (int64_t d = 0; d < D; ++d) {
    Vec keys[kKeyVecs];
    for (int c = 0; c < kKeyVecs; ++c) keys[c] = Vec::loadu(column + d * stride + c * V);
    for (int r = 0; r < RT; ++r) {
      const Vec qd(q[r][d]);
      for (int c = 0; c < kKeyVecs; ++c) acc[r][c] = at::vec::fmadd(qd, keys[c], acc[r][c]);
    }
  }
  const Vec scale(rows.pb->scale);
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < kKeyVecs; ++c) (acc[r][c] * scale).store(scores + (r0 + r) * width + c0 + c * V);
}

// out rows r0 .. r0 + RT - 1, head-dim vectors [d0, d0 + NV): the probabilities of each row's keys (its
// scores' row, from column lo_r - klo) times the values, over [jlo, jhi] for all RT rows together and the
// rest of each row's keys alone; times each row's 1 / sum
template <int RT, int NV>
inline void output_tile(const Rows& rows, int64_t r0, int64_t d0, const float* probs, int64_t width, int64_t klo,
                        const float* inv_sum) {
  const Problem& pb = *rows.pb;
  const int64_t value_stride = pb.Hkv * pb.D;
  const float* values = pb.v + rows.h * pb.D + d0;
  int64_t lo[RT], hi[RT], jlo = 0, jhi = pb.Lk;
  for (int r = 0; r < RT; ++r) {
    hi[r] = rows.position(r0 + r);
    lo[r] = pb.lo(hi[r]);
    jlo = std::max(jlo, lo[r]);
    jhi = std::min(jhi, hi[r]);
  }
  if (jhi < jlo) jhi = jlo - 1;  // no key all RT rows see: each row's keys alone, below and from jlo
  Vec acc[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec(0.f);
  for (int64_t j = jlo; j <= jhi; ++j) {
    const float* vj = values + j * value_stride;
    Vec vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = Vec::loadu(vj + c * V);
    for (int r = 0; r < RT; ++r) {
      const Vec p(probs[(r0 + r) * width + j - klo]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(p, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    const float* row = probs + (r0 + r) * width - klo;
    auto alone = [&](int64_t j) {
      const Vec p(row[j]);
      const float* vj = values + j * value_stride;
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(p, Vec::loadu(vj + c * V), acc[r][c]);
    };
    for (int64_t j = lo[r]; j < std::min(jlo, hi[r] + 1); ++j) alone(j);
    for (int64_t j = std::max(jhi + 1, lo[r]); j <= hi[r]; ++j) alone(j);
    float* out = rows.output(r0 + r) + d0;
    for (int c = 0; c < NV; ++c) (acc[r][c] * Vec(inv_sum[r0 + r])).store(out + c * V);
  }
}

template <int RT>
inline void output_rows(const Rows& rows, int64_t r0, const float* probs, int64_t width, int64_t klo,
                        const float* inv_sum) {
  const int64_t vecs = rows.pb->D / V;
  int64_t c = 0;
  for (; c + kOutVecs <= vecs; c += kOutVecs) {
    output_tile<RT, kOutVecs>(rows, r0, c * V, probs, width, klo, inv_sum);
  }
  for (; c < vecs; ++c) output_tile<RT, 1>(rows, r0, c * V, probs, width, klo, inv_sum);
}

// One item: scores of its rows against keys [klo, khi], each row's softmax, then its outputs.
void attend_item(const Rows& rows, const float* kt, int64_t stride, std::vector<float>& scratch) {
  const Problem& pb = *rows.pb;
  const int64_t R = pb.G * rows.n;
  const int64_t klo = pb.lo(rows.position(0)), khi = rows.position(rows.n - 1);
  const int64_t tile = kKeyVecs * V;
  const int64_t width = (khi - klo + tile) / tile * tile;
  scratch.resize(R * width + R);
  float* scores = scratch.data();
  float* inv_sum = scores + R * width;
  for (int64_t r0 = 0; r0 < R; r0 += kRows) {
    const int64_t rt = std::min<int64_t>(kRows, R - r0);
    int64_t first = khi, last = klo;  // the tile's rows' keys
    for (int64_t r = r0; r < r0 + rt; ++r) {
      first = std::min(first, pb.lo(rows.position(r)));
      last = std::max(last, rows.position(r));
    }
    for (int64_t c0 = (first - klo) / tile * tile; c0 <= last - klo; c0 += tile) {
      switch (rt) {
        case 1: score_tile<1>(rows, r0, kt, stride, klo, c0, scores, width); break;
        case 2: score_tile<2>(rows, r0, kt, stride, klo, c0, scores, width); break;
        case 3: score_tile<3>(rows, r0, kt, stride, klo, c0, scores, width); break;
        default: score_tile<4>(rows, r0, kt, stride, klo, c0, scores, width); break;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t p = rows.position(r), lo = pb.lo(p);
    float* s = scores + r * width + lo - klo;
    const int64_t n = p - lo + 1;
    const float m = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s, n);
    at::vec::map([m](Vec x) { return (x - Vec(m)).exp(); }, s, s, n);
    inv_sum[r] = 1.f / at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, s, n);
  }
  for (int64_t r0 = 0; r0 < R; r0 += kRows) {
    switch (std::min<int64_t>(kRows, R - r0)) {
      case 1: output_rows<1>(rows, r0, scores, width, klo, inv_sum); break;
      case 2: output_rows<2>(rows, r0, scores, width, klo, inv_sum); break;
      case 3: output_rows<3>(rows, r0, scores, width, klo, inv_sum); break;
      default: output_rows<4>(rows, r0, scores, width, klo, inv_sum); break;
    }
  }
}

}  // namespace

namespace kiln_cpu {

bool causal_attention_head_dim(int64_t head_dim) { return head_dim > 0 && head_dim % V == 0; }

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            int64_t window) {
  const char* op = "causal_attention";
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op, ": CPU tensors only");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3, op,
                ": q, k and v must be float32 [L, heads, D], got ", t->scalar_type(), " ", t->sizes());
  }
  const int64_t Lq = q.size(0), H = q.size(1), D = q.size(2), Lk = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == D, op, ": k and v must be [Lk, Hkv, D] with q's D = ", D,
              ", got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, op, ": query heads (", H, ") must be a multiple of kv heads (", Hkv, ")");
  TORCH_CHECK(Lk >= Lq, op, ": the queries are the last Lq positions, so Lk (", Lk, ") must be >= Lq (", Lq, ")");
  TORCH_CHECK(causal_attention_head_dim(D), op, ": head_dim ", D, " must be a multiple of ", V);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (Lq == 0 || H == 0) return out;
  Problem pb{qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), out.data_ptr<float>(),
             Lq, Lk, H, Hkv, D, H / Hkv, static_cast<float>(scale), window};

  // each kv head's keys as [D][stride]: a vector of keys per load; zero past Lk (tiles may read there)
  const int64_t stride = (Lk + kKeyVecs * V - 1) / (kKeyVecs * V) * (kKeyVecs * V) + kKeyVecs * V;
  std::vector<float> kt(Hkv * D * stride, 0.f);
  at::parallel_for(0, Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      float* t = kt.data() + h * D * stride;
      for (int64_t j = 0; j < Lk; ++j) {
        const float* key = pb.k + (j * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) t[d * stride + j] = key[d];
      }
    }
  });

  // blocks of query positions: about 256 K floats of scores an item, 4 to 32 positions
  const int64_t fit = (int64_t{1} << 18) / (pb.G * stride);
  const int64_t block = std::max<int64_t>(kRows, std::min<int64_t>(32, fit) / kRows * kRows);
  const int64_t blocks = (Lq + block - 1) / block;
  // items in an order that pairs a late block (many keys) with an early one (few), so that the threads'
  // contiguous shares of the causal triangle are about equal
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % Hkv, slot = item / Hkv;
      const int64_t b = slot % 2 == 0 ? slot / 2 : blocks - 1 - slot / 2;
      const Rows rows{h, b * block, std::min(block, Lq - b * block), &pb};
      attend_item(rows, kt.data() + h * D * stride, stride, scratch);
    }
  });
  return out;
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale, int window) -> Tensor");
  m.def("causal_attention_head_dim(int head_dim) -> bool", &kiln_cpu::causal_attention_head_dim);
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("causal_attention", &kiln_cpu::causal_attention); }
