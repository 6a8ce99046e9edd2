// The native CPU RMSNorm of rms_norm's "cpu" implementation (cpu.py) for float32 tensors: per row,
// optionally s = x + residual written back into residual, then y = s * rsqrt(mean(s^2) + eps) *
// (weight + weight_offset), one pass over the row for the sum of squares and one for the output.
// PyTorch's CPU rms_norm is a composite of ~8 ATen calls (pow, mean, add, rsqrt, mul...): ~20 us for
// one 576-wide row on 2 cores, most of a decode step's norm time; this is one call. Statistics in
// float32, as the op's contract says. Registered as torch.ops.kiln_cpu.rms_norm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "native_cpu_ops.h"

#include <cmath>
#include <optional>

namespace {

using Vec = at::vec::Vectorized<float>;

void norm_row(const float* x, float* residual, const float* weight, float offset, float eps, int64_t d, float* y) {
  const float* s = x;
  int64_t i = 0;
  Vec sum(0.f);
  if (residual != nullptr) {  // residual += x, the sum of squares of the new residual on the way
    for (; i + Vec::size() <= d; i += Vec::size()) {
      const Vec v = Vec::loadu(x + i) + Vec::loadu(residual + i);
      v.store(residual + i);
      sum = at::vec::fmadd(v, v, sum);
    }
    s = residual;
  } else {
    for (; i + Vec::size() <= d; i += Vec::size()) {
      const Vec v = Vec::loadu(x + i);
      sum = at::vec::fmadd(v, v, sum);
    }
  }
  float lanes[Vec::size()];  // a plain horizontal sum: vec_reduce_all's signature differs across ISAs
  sum.store(lanes);
  float total = 0.f;
  for (int64_t l = 0; l < Vec::size(); ++l) total += lanes[l];
  for (; i < d; ++i) {
    const float v = residual != nullptr ? (residual[i] += x[i]) : x[i];
    total += v * v;
  }
  const float rstd = 1.f / std::sqrt(total / static_cast<float>(d) + eps);
  const Vec scale(rstd), shift(offset);
  int64_t j = 0;
  for (; j + Vec::size() <= d; j += Vec::size()) {
    (Vec::loadu(s + j) * scale * (Vec::loadu(weight + j) + shift)).store(y + j);
  }
  for (; j < d; ++j) y[j] = s[j] * rstd * (weight[j] + offset);
}

}  // namespace

namespace kiln_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual, double weight_offset) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "kiln_cpu.rms_norm: x must be a float32 CPU tensor [..., hidden], got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == d,
              "kiln_cpu.rms_norm: weight must be float32 [", d, "], got ", weight.scalar_type(), " ", weight.sizes());
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->sizes() == x.sizes() &&
                    residual->is_contiguous(),
                "kiln_cpu.rms_norm: residual must be a contiguous float32 tensor shaped like x ", x.sizes(),
                ", got ", residual->scalar_type(), " ", residual->sizes());
  }
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = d == 0 ? 0 : xc.numel() / d;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const float offset = static_cast<float>(weight_offset), epsilon = static_cast<float>(eps);
  // a decode step's one row stays on this thread: a parallel region costs more than the row
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(xp + r * d, rp == nullptr ? nullptr : rp + r * d, wp, offset, epsilon, d, yp + r * d);
    }
  });
  return y;
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual, float weight_offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("rms_norm", &kiln_cpu::rms_norm); }
