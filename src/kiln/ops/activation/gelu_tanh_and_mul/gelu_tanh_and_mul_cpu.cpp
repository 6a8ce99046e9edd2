// The native CPU gated activation of gelu_tanh_and_mul's "cpu" implementation (cpu.py) for float32:
// y[t, j] = gelu_tanh(x[t, j]) * x[t, d + j] in one pass, tanh-GELU as sigmoid(2 z):
// 0.5 (1 + tanh(z)) = sigmoid(2 z) with 2 z = 2 sqrt(2 / pi) (a + 0.044715 a^3), which saturates where
// 1 + tanh(z) would cancel (a << 0); the exp is ATen's vectorized one. Gemma's MLP: one call a layer
// instead of the tensor form's six ATen calls. Registered as torch.ops.kiln_cpu.gelu_tanh_and_mul.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "activation/cpu_gated_rows.h"
#include "native_cpu_ops.h"

#include <cmath>

namespace kiln_cpu {

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  using Vec = at::vec::Vectorized<float>;
  constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;  // 2 sqrt(2 / pi)
  return gated_rows(
      "kiln_cpu.gelu_tanh_and_mul", x,
      [](const Vec& a) {
        const Vec z2 = (a * a * Vec(0.044715f) + Vec(1.f)) * a * Vec(kTwoSqrt2OverPi);
        return a / (Vec(1.f) + z2.neg().exp());
      },
      [](float a) {
        const float z2 = (a * a * 0.044715f + 1.f) * a * kTwoSqrt2OverPi;
        return a / (1.f + std::exp(-z2));
      });
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) { m.def("gelu_tanh_and_mul(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("gelu_tanh_and_mul", &kiln_cpu::gelu_tanh_and_mul); }
