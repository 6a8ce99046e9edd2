// W8A8 linear for CPU: y = (x quantized to int8 per row) @ (int8 weight per output channel)^T, on
// oneDNN's int8 GEMM (AVX512-VNNI / AMX where the host has them).
//
// Registered as torch.ops.kiln_cpu.w8a8_linear (built and loaded by kiln/ops/native_cpu.py; cpu_w8a8.py
// gives it its fake implementation so compiled graphs hold it as one node). x is quantized per row as
// cpu_w8a8_quantize.h says (SmoothQuant factors first); CPUs with AMX run cpu_w8a8_amx.cpp instead.
// oneDNN multiplies q by the packed weight with int32 accumulation (exact) and the weight's scale per
// output channel, in float32; this file then multiplies each row by s_m, adds the bias and rounds
// once to the output dtype. Its call overhead is one op instead of the ~6 small ops (amax, divide,
// round, clamp, cast, rescale) the same math costs in PyTorch around oneDNN's op.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_w8a8_quantize.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using kiln_w8a8::kGrainElements;
using kiln_w8a8::Vec;

template <typename T>
void scale_rows(const float* y, const float* row_scales, const float* bias, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Vec s(row_scales[r]);
      const float* yr = y + r * n;
      T* o = out + r * n;
      int64_t j = 0;
      if constexpr (std::is_same_v<T, float>) {
        for (; j + Vec::size() <= n; j += Vec::size()) {
          Vec v = Vec::loadu(yr + j) * s;
          if (bias) v = v + Vec::loadu(bias + j);
          v.store(o + j);
        }
      } else {  // bfloat16 / float16: two float vectors round into one of T
        for (; j + 2 * Vec::size() <= n; j += 2 * Vec::size()) {
          Vec a = Vec::loadu(yr + j) * s, b = Vec::loadu(yr + j + Vec::size()) * s;
          if (bias) {
            a = a + Vec::loadu(bias + j);
            b = b + Vec::loadu(bias + j + Vec::size());
          }
          at::vec::convert_from_float<T>(a, b).store(o + j);
        }
      }
      for (; j < n; ++j) o[j] = static_cast<T>(yr[j] * row_scales[r] + (bias ? bias[j] : 0.f));
    }
  });
}

// x [M, K] float32 / bfloat16 / float16; weight: torch.ops.onednn.qlinear_prepack of an int8 [N, K]
// matrix (reports shape [K, N]); w_scale float32 [N]; w_zero_point int64 [N] (zeros: symmetric);
// smooth float32 [K]; bias float32 [N] or None. Returns [M, N] in out_dtype (float32 / bfloat16 / float16).
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& w_scale,
                       const at::Tensor& w_zero_point, const at::Tensor& smooth,
                       const std::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "kiln_cpu.w8a8_linear: x [M, K] and a packed weight");
  TORCH_CHECK(weight.size(0) == x.size(1), "kiln_cpu.w8a8_linear: x has ", x.size(1),
              " in-features, the weight ", weight.size(0));
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == weight.size(1),
              "kiln_cpu.w8a8_linear: w_scale must be float32 [N]");
  TORCH_CHECK(smooth.scalar_type() == at::kFloat && smooth.numel() == x.size(1),
              "kiln_cpu.w8a8_linear: smooth must be float32 [K]");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(1);
  at::Tensor out = at::empty({m, n}, x.options().dtype(out_dtype).layout(at::kStrided));
  if (m == 0) return out;
  at::Tensor xc = x.contiguous();
  at::Tensor q = at::empty({m, k}, xc.options().dtype(at::kByte));
  at::Tensor row_scales = at::empty({m}, xc.options().dtype(at::kFloat));
  const at::Tensor smooth_c = smooth.contiguous();
  // oneDNN multiplies uint8 activations with a zero point on its VNNI / AMX kernels, while int8 ones
  // reach its reference loop on CPUs without AMX (~0.1 GFLOP/s on an AVX512-VNNI Xeon, 2000x slower):
  // so each level v goes in as v + 128 with zero point 128, the int8's bits with the sign bit flipped.
  // The products stay exact: oneDNN subtracts 128 * (column sums) in int32.
  AT_DISPATCH_SWITCH(xc.scalar_type(), "kiln_cpu_w8a8_quantize", KILN_W8A8_DTYPES([&] {
    kiln_w8a8::quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), smooth_c.data_ptr<float>(),
                                       reinterpret_cast<int8_t*>(q.data_ptr<uint8_t>()),
                                       row_scales.data_ptr<float>(), m, k, k, 0x80);
  }));
  static const auto qlinear = c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  std::vector<c10::IValue> stack{q, 1.0, int64_t(128), weight, w_scale, w_zero_point, c10::IValue(),
                                 1.0, int64_t(0), c10::IValue(at::kFloat), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::string("")};
  qlinear.callBoxed(&stack);
  const at::Tensor y = stack[0].toTensor().contiguous();
  const at::Tensor bias_f = kiln_w8a8::float_bias(bias, n, "kiln_cpu.w8a8_linear");
  const float* bias_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  AT_DISPATCH_SWITCH(out_dtype, "kiln_cpu_w8a8_scale", KILN_W8A8_DTYPES([&] {
    scale_rows<scalar_t>(y.data_ptr<float>(), row_scales.data_ptr<float>(), bias_ptr, out.data_ptr<scalar_t>(), m, n);
  }));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def(
      "w8a8_linear(Tensor x, Tensor weight, Tensor w_scale, Tensor w_zero_point, Tensor smooth, "
      "Tensor? bias, ScalarType out_dtype) -> Tensor");
}

// the packed weight is a oneDNN (MkldnnCPU) tensor, so the call dispatches on that key
TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
TORCH_LIBRARY_IMPL(kiln_cpu, MkldnnCPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
