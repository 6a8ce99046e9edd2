// The native CPU rotary embedding of rotary_embedding's "cpu" implementation (cpu.py) for float32 q
// and k: each head's first rotary_dim values rotated in place by its position's cos / sin row of the
// cache (cos half, then sin half), NeoX pairs (i, i + r) or GPT-J pairs (2i, 2i + 1). q and k may be
// strided views (the columns of a fused QKV projection's output): only the last dim must be dense.
// One call instead of the ~10 ATen calls of the tensor form (~50 us for SmolLM2's 9 + 3 heads at one
// token on 2 cores). Registered as torch.ops.kiln_cpu.rotary_embedding_.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "native_cpu_ops.h"

#include <cstdint>

namespace {

void rotate_heads(float* x, int64_t heads, int64_t head_stride, const float* cos, const float* sin, int64_t r,
                  bool is_neox) {
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_stride;
    if (is_neox) {
      for (int64_t i = 0; i < r; ++i) {
        const float a = v[i], b = v[i + r];
        v[i] = a * cos[i] - b * sin[i];
        v[i + r] = b * cos[i] + a * sin[i];
      }
    } else {
      for (int64_t i = 0; i < r; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cos[i] - b * sin[i];
        v[2 * i + 1] = b * cos[i] + a * sin[i];
      }
    }
  }
}

void check_heads(const char* name, const at::Tensor& t, int64_t tokens, int64_t rotary_dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(0) == tokens && t.stride(2) == 1 &&
                  t.size(2) >= rotary_dim,
              "kiln_cpu.rotary_embedding_: ", name, " must be float32 [", tokens,
              ", heads, head_dim >= rotary_dim] with a dense last dim, got ", t.scalar_type(), " ", t.sizes(),
              " strides ", t.strides());
}

}  // namespace

namespace kiln_cpu {

void rotary_embedding_(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos_sin_cache,
                       bool is_neox) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1,
              "kiln_cpu.rotary_embedding_: positions must be int64 [T], got ", positions.scalar_type(), " ",
              positions.sizes());
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.size(1) % 2 == 0,
              "kiln_cpu.rotary_embedding_: cos_sin_cache must be float32 [max_position, rotary_dim], got ",
              cos_sin_cache.scalar_type(), " ", cos_sin_cache.sizes());
  const int64_t tokens = positions.size(0), rotary_dim = cos_sin_cache.size(1), r = rotary_dim / 2;
  check_heads("q", q, tokens, rotary_dim);
  check_heads("k", k, tokens, rotary_dim);
  const at::Tensor pc = positions.contiguous(), cache = cos_sin_cache.contiguous();
  const int64_t* pos = pc.data_ptr<int64_t>();
  const int64_t max_position = cache.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "kiln_cpu.rotary_embedding_: position ", pos[t],
                " of token ", t, " is outside the cos/sin cache's [0, ", max_position, ")");
  }
  const float* cp = cache.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  at::parallel_for(0, tokens, 32, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cp + pos[t] * rotary_dim;
      rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), cos, cos + r, r, is_neox);
      rotate_heads(kp + t * k.stride(0), k.size(1), k.stride(1), cos, cos + r, r, is_neox);
    }
  });
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("rotary_embedding_(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache, bool is_neox) -> ()");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("rotary_embedding_", &kiln_cpu::rotary_embedding_); }
