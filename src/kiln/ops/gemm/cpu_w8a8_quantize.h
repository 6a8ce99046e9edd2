// Per-row int8 quantization of activations, shared by Kiln's two CPU W8A8 GEMMs (cpu_w8a8.cpp on
// oneDNN, cpu_w8a8_amx.cpp on AMX tiles). Each input column k is first multiplied by smooth[k]
// (SmoothQuant; ones: none). Per row m of that: s_m = max(max_k |x[m, k]|, 1e-12) / 127 and
// q[m, k] = round-half-even(x[m, k] * (1 / s_m)) in [-127, 127], every step in float32. A row with a
// NaN gets scale NaN (its output row is NaN) and levels 0.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kiln_w8a8 {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrainElements = 1 << 15;  // below this many elements per thread, one thread

// Rows [begin, end) of x [rows, k] into q (row stride q_stride >= k; columns past k untouched) and
// scales. A plain function of locals: int8 stores may alias anything, so with the sizes read through
// a lambda's captures the compiler reloads them on every element and leaves the int8 loop scalar.
// sign_flip 0x80 stores each level v as the uint8 v + 128 (the same bits with the sign bit flipped).
template <typename T>
void quantize_row_range(const T* __restrict x, const float* __restrict smooth, int8_t* __restrict q,
                        float* __restrict scales, const int64_t begin, const int64_t end, const int64_t k,
                        const int64_t q_stride, const int32_t sign_flip) {
  std::vector<float> buffer(k);
  float* __restrict f = buffer.data();
  const Vec zero(0.f), low(-127.f), high(127.f);
  for (int64_t r = begin; r < end; ++r) {
    const T* __restrict row = x + r * k;
    for (int64_t i = 0; i < k; ++i) f[i] = static_cast<float>(row[i]) * smooth[i];
    Vec peak(0.f);
    int64_t i = 0;
    for (; i + Vec::size() <= k; i += Vec::size()) peak = at::vec::maximum(peak, Vec::loadu(f + i).abs());
    float amax = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, peak);
    for (; i < k; ++i) amax = std::isnan(f[i]) ? f[i] : std::max(amax, std::abs(f[i]));
    const float scale = std::max(amax, 1e-12f) / 127.f;
    scales[r] = std::isnan(amax) ? amax : scale;
    const Vec inverse(1.f / scale);
    for (i = 0; i + Vec::size() <= k; i += Vec::size()) {  // the levels as floats, NaN -> 0
      const Vec v = at::vec::clamp((Vec::loadu(f + i) * inverse).round(), low, high);
      Vec::blendv(v, zero, v.isnan()).store(f + i);
    }
    for (; i < k; ++i) {  // NaN tested before the clamp, which would turn it into -127
      const float v = std::nearbyint(f[i] * (1.f / scale));
      f[i] = std::isnan(v) ? 0.f : std::min(127.f, std::max(-127.f, v));
    }
    int8_t* __restrict out = q + r * q_stride;
    for (i = 0; i < k; ++i) out[i] = static_cast<int8_t>(static_cast<int32_t>(f[i]) ^ sign_flip);
  }
}

// x [rows, k] -> q [rows, q_stride] int8 levels (as uint8 + 128 with sign_flip 0x80) and scales
// [rows], rows split across threads; k > 0.
template <typename T>
void quantize_rows(const T* x, const float* smooth, int8_t* q, float* scales, int64_t rows, int64_t k,
                   int64_t q_stride, int32_t sign_flip = 0) {
  TORCH_CHECK(k > 0, "kiln_cpu W8A8: x has no in-features");
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / k), [&](int64_t begin, int64_t end) {
    quantize_row_range(x, smooth, q, scales, begin, end, k, q_stride, sign_flip);
  });
}

// the activation and output dtypes both ops take
#define KILN_W8A8_DTYPES(...)                  \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
  AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
  AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)

// bias [n] as contiguous float32, or undefined when absent
inline at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, op, ": bias has ", bias->numel(), " elements, expected ", n);
  return bias->to(at::kFloat).contiguous();
}

}  // namespace kiln_w8a8
