// The native CPU gated activation of silu_and_mul's "cpu" implementation (cpu.py) for float32:
// y[t, j] = silu(x[t, j]) * x[t, d + j], silu(a) = a / (1 + exp(-a)), in one pass (ATen's vectorized exp,
// as PyTorch's own silu kernel uses). Registered as torch.ops.kiln_cpu.silu_and_mul.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "activation/cpu_gated_rows.h"
#include "native_cpu_ops.h"

#include <cmath>

namespace kiln_cpu {

at::Tensor silu_and_mul(const at::Tensor& x) {
  using Vec = at::vec::Vectorized<float>;
  return gated_rows(
      "kiln_cpu.silu_and_mul", x, [](const Vec& a) { return a / (Vec(1.f) + a.neg().exp()); },
      [](float a) { return a / (1.f + std::exp(-a)); });
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) { m.def("silu_and_mul(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("silu_and_mul", &kiln_cpu::silu_and_mul); }
