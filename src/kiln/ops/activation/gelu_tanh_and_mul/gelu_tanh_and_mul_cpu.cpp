// The native CPU gated activation of gelu_tanh_and_mul's "cpu" implementation (cpu.py) for float32:
// y[t, j] = gelu_tanh(x[t, j]) * x[t, d + j] in one pass, tanh-GELU as sigmoid(2 z):
// 0.5 (1 + tanh(z)) = sigmoid(2 z) with 2 z = 2 sqrt(2 / pi) (a + 0.044715 a^3), which saturates where
// 1 + tanh(z) would cancel (a << 0); the exp is ATen's vectorized one. Gemma's MLP: one call a layer
// instead of the tensor form's six ATen calls. Registered as torch.ops.kiln_cpu.gelu_tanh_and_mul.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "native_cpu_ops.h"

#include <algorithm>
#include <cmath>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;  // 2 sqrt(2 / pi)

}  // namespace

namespace kiln_cpu {

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "kiln_cpu.gelu_tanh_and_mul: x must be a float32 CPU tensor [..., 2 * d], got ", x.scalar_type(),
              " ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t width = xc.size(-1), d = width / 2, rows = width == 0 ? 0 : xc.numel() / width;
  auto shape = xc.sizes().vec();
  shape.back() = d;
  at::Tensor y = at::empty(shape, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const Vec one(1.f), cubic(0.044715f), scale(kTwoSqrt2OverPi);
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * width;
      const float* up = gate + d;
      float* out = yp + r * d;
      int64_t j = 0;
      for (; j + Vec::size() <= d; j += Vec::size()) {
        const Vec a = Vec::loadu(gate + j);
        const Vec z2 = (a * a * cubic + one) * a * scale;
        (a / (one + z2.neg().exp()) * Vec::loadu(up + j)).store(out + j);
      }
      for (; j < d; ++j) {
        const float a = gate[j], z2 = (a * a * 0.044715f + 1.f) * a * kTwoSqrt2OverPi;
        out[j] = a / (1.f + std::exp(-z2)) * up[j];
      }
    }
  });
  return y;
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) { m.def("gelu_tanh_and_mul(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("gelu_tanh_and_mul", &kiln_cpu::gelu_tanh_and_mul); }
