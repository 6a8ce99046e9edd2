// The row loop of the native gated activations (silu_and_mul_cpu.cpp, gelu_tanh_and_mul_cpu.cpp):
// float32 x [..., 2 d] -> y [..., d], y[t, j] = act(x[t, j]) * x[t, d + j], rows split across threads,
// each row in Vectorized<float> steps, then a scalar tail. `vec(a)` and `scalar(a)` are the activation.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

namespace kiln_cpu {

template <class VecAct, class ScalarAct>
at::Tensor gated_rows(const char* op, const at::Tensor& x, VecAct vec, ScalarAct scalar) {
  using Vec = at::vec::Vectorized<float>;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) % 2 == 0, op,
              ": x must be a float32 CPU tensor [..., 2 * d], got ", x.scalar_type(), " ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t width = xc.size(-1), d = width / 2, rows = width == 0 ? 0 : xc.numel() / width;
  auto shape = xc.sizes().vec();
  shape.back() = d;
  at::Tensor y = at::empty(shape, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * width;
      const float* up = gate + d;
      float* out = yp + r * d;
      int64_t j = 0;
      for (; j + Vec::size() <= d; j += Vec::size()) (vec(Vec::loadu(gate + j)) * Vec::loadu(up + j)).store(out + j);
      for (; j < d; ++j) out[j] = scalar(gate[j]) * up[j];
    }
  });
  return y;
}

}  // namespace kiln_cpu
