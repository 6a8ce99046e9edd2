// W8A8 linear on Intel AMX tiles: y = (x quantized to int8 per row) @ (int8 weight per output channel)^T,
// without oneDNN. Registered as torch.ops.kiln_cpu.w8a8_amx_linear and kiln_cpu.amx_int8_available
// (built and loaded by kiln/ops/native_cpu.py; cpu_w8a8.py packs the weights and gives the op its fake).
//
// Why not oneDNN's int8 GEMM (cpu_w8a8.cpp): at decode sizes (16 rows, SmolLM2's 576 x 960 projection)
// torch's qlinear_pointwise spends ~30 us a call around a few microseconds of AMX work (primitive and
// memory descriptors, scratchpad, output allocation), then this library's rescale pass follows. Here
// one pass quantizes x, one loop over the weight multiplies it on tiles and rescales each finished tile
// straight into the output.
//
// Weight layout (cpu_w8a8.to_tiles): int8 [ceil(N / 64), ceil(K / 64), 4, 16, 64], N and K padded with zeros.
// Element [g, kb, j, r, 4 * c + i] = W[64 g + 16 j + c, 64 kb + 4 r + i]: for column group g and K step
// kb, four B tiles (16 columns each) in the layout TDPBSSD reads (four consecutive k of one column in
// one 32-bit lane), so each group's weights are one sequential stream.
// Per 16-row block of x and group: C_j += A (16 rows x 64 k) . B_j over the K steps, exact int32; then
// y[m, n] = (float(C[m, n]) * w_scale[n]) * x_scale[m] + bias[n], rounded once to the output dtype (the
// order oneDNN's path uses).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_amx.h"
#include "cpu_w8a8_quantize.h"

#include <cstdint>

namespace {

constexpr int64_t kRows = 16;      // rows of an A / C tile
constexpr int64_t kStep = 64;      // int8 k per tile row
constexpr int64_t kGroup = 64;     // output columns per group: four C tiles of 16
constexpr int64_t kTileBytes = 1024;
// the weight stream is prefetched two K steps (8 KiB) ahead on a group's first row block: SmolLM2's
// 120 decoder GEMMs at 16 rows, cache-cold, 6.2-6.5 ms against 6.8-6.9 without (16 KiB: 6.6)
constexpr int64_t kPrefetchAhead = 2 * 4 * kTileBytes;

#ifdef KILN_AMX

// tmm0-3: C for the group's four column blocks; tmm4: A; tmm5-7: B
void configure_tiles() {
  kiln_cpu::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kRows;
    config.colsb[t] = kStep;
  }
  kiln_cpu::load_tile_config(config);
}

// C [16][64] int32 = A (16 rows of xq from `a`, row stride a_stride) times one group's weights `b`;
// read ahead in the weight stream, within the prefetch_bytes that follow `b` (0: later row blocks, which
// find the group in cache)
__attribute__((target("amx-tile,amx-int8"))) void group_product(const int8_t* a, int64_t a_stride,
                                                                const int8_t* b, int64_t steps, int32_t* c,
                                                                int64_t prefetch_bytes) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s, b += 4 * kTileBytes, prefetch_bytes -= 4 * kTileBytes) {
    if (prefetch_bytes >= kPrefetchAhead + 4 * kTileBytes)
      for (int64_t line = 0; line < 4 * kTileBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchAhead + line), _MM_HINT_T0);
    _tile_loadd(4, a + s * kStep, a_stride);
    _tile_loadd(5, b, kStep);
    _tile_dpbssd(0, 4, 5);
    _tile_loadd(6, b + kTileBytes, kStep);
    _tile_dpbssd(1, 4, 6);
    _tile_loadd(7, b + 2 * kTileBytes, kStep);
    _tile_dpbssd(2, 4, 7);
    _tile_loadd(5, b + 3 * kTileBytes, kStep);
    _tile_dpbssd(3, 4, 5);
  }
  constexpr int64_t stride = kGroup * sizeof(int32_t);
  _tile_stored(0, c, stride);
  _tile_stored(1, c + 16, stride);
  _tile_stored(2, c + 32, stride);
  _tile_stored(3, c + 48, stride);
}

// rows [0, rows) of C [16][64] -> out columns [n0, n0 + width) of rows r0..: see the header comment
template <typename T>
void rescale_tile(const int32_t* c, const float* x_scales, const float* w_scale, const float* bias, T* out,
                  int64_t out_stride, int64_t rows, int64_t n0, int64_t width) {
  using Vec = at::vec::Vectorized<float>;
  using IVec = at::vec::Vectorized<int32_t>;
  static_assert(kGroup % (2 * Vec::size()) == 0, "a group is whole pairs of vectors");
  for (int64_t m = 0; m < rows; ++m) {
    const int32_t* cm = c + m * kGroup;
    T* o = out + m * out_stride + n0;
    const Vec s(x_scales[m]);
    if (width == kGroup) {
      for (int64_t j = 0; j < kGroup; j += 2 * Vec::size()) {
        Vec a = at::vec::convert<float>(IVec::loadu(cm + j)) * Vec::loadu(w_scale + n0 + j) * s;
        Vec b = at::vec::convert<float>(IVec::loadu(cm + j + Vec::size())) *
                Vec::loadu(w_scale + n0 + j + Vec::size()) * s;
        if (bias) {
          a = a + Vec::loadu(bias + n0 + j);
          b = b + Vec::loadu(bias + n0 + j + Vec::size());
        }
        if constexpr (std::is_same_v<T, float>) {
          a.store(o + j);
          b.store(o + j + Vec::size());
        } else {
          at::vec::convert_from_float<T>(a, b).store(o + j);
        }
      }
    } else {
      for (int64_t j = 0; j < width; ++j)
        o[j] = static_cast<T>(static_cast<float>(cm[j]) * w_scale[n0 + j] * x_scales[m] +
                              (bias ? bias[n0 + j] : 0.f));
    }
  }
}

#endif  // KILN_AMX

// x [M, K] float32 / bfloat16 / float16; tiles int8 [ceil(N / 64), ceil(K / 64), 4, 16, 64] (the layout
// above); w_scale float32 [N]; smooth float32 [K]; bias float [N] or None. Returns [M, N] in out_dtype.
at::Tensor w8a8_amx_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& w_scale,
                           const at::Tensor& smooth, const std::optional<at::Tensor>& bias,
                           at::ScalarType out_dtype) {
  TORCH_CHECK(kiln_cpu::amx_int8_usable(), "kiln_cpu.w8a8_amx_linear: this CPU (or kernel) offers no AMX int8 tiles");
  TORCH_CHECK(x.dim() == 2, "kiln_cpu.w8a8_amx_linear: x must be [M, K], got ", x.dim(), " dims");
  TORCH_CHECK(tiles.dim() == 5 && tiles.scalar_type() == at::kChar && tiles.is_contiguous() &&
                  tiles.size(2) == 4 && tiles.size(3) == kRows && tiles.size(4) == kStep,
              "kiln_cpu.w8a8_amx_linear: tiles must be contiguous int8 [N/64, K/64, 4, 16, 64]");
  const int64_t m = x.size(0), k = x.size(1), n = w_scale.numel();
  const int64_t groups = tiles.size(0), steps = tiles.size(1);
  TORCH_CHECK(steps == (k + kStep - 1) / kStep, "kiln_cpu.w8a8_amx_linear: x has ", k,
              " in-features, the tiles ", steps * kStep, " (padded)");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && groups == (n + kGroup - 1) / kGroup,
              "kiln_cpu.w8a8_amx_linear: w_scale must be float32 [N] with N / 64 groups of tiles");
  TORCH_CHECK(smooth.scalar_type() == at::kFloat && smooth.numel() == k,
              "kiln_cpu.w8a8_amx_linear: smooth must be float32 [K]");
  at::Tensor out = at::empty({m, n}, x.options().dtype(out_dtype));
  if (m == 0 || n == 0) return out;
#ifdef KILN_AMX
  const at::Tensor xc = x.contiguous(), smooth_c = smooth.contiguous(), scale_c = w_scale.contiguous();
  const at::Tensor bias_f = kiln_w8a8::float_bias(bias, n, "kiln_cpu.w8a8_amx_linear");
  const int64_t blocks = (m + kRows - 1) / kRows, padded_k = steps * kStep;
  // zeros: the padding rows and columns take part in the tile products
  at::Tensor q = at::zeros({blocks * kRows, padded_k}, xc.options().dtype(at::kChar));
  at::Tensor x_scales = at::empty({m}, xc.options().dtype(at::kFloat));
  AT_DISPATCH_SWITCH(xc.scalar_type(), "kiln_cpu_w8a8_amx_quantize", KILN_W8A8_DTYPES([&] {
    kiln_w8a8::quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), smooth_c.data_ptr<float>(), q.data_ptr<int8_t>(),
                                       x_scales.data_ptr<float>(), m, k, padded_k);
  }));
  const int8_t* qp = q.data_ptr<int8_t>();
  const int8_t* wp = tiles.data_ptr<int8_t>();
  const float* xs = x_scales.data_ptr<float>();
  const float* ws = scale_c.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t group_bytes = steps * 4 * kTileBytes;
  AT_DISPATCH_SWITCH(out_dtype, "kiln_cpu_w8a8_amx", KILN_W8A8_DTYPES([&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      alignas(64) int32_t c[kRows * kGroup];
      configure_tiles();
      for (int64_t g = begin; g < end; ++g) {
        const int64_t n0 = g * kGroup, width = std::min(kGroup, n - n0);
        for (int64_t b = 0; b < blocks; ++b) {
          group_product(qp + b * kRows * padded_k, padded_k, wp + g * group_bytes, steps, c,
                        b == 0 ? (groups - g) * group_bytes : 0);
          const int64_t r0 = b * kRows;
          rescale_tile<scalar_t>(c, xs + r0, ws, bp, op + r0 * n, n, std::min(kRows, m - r0), n0, width);
        }
      }
      kiln_cpu::release_tiles();
    });
  }));
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def(
      "w8a8_amx_linear(Tensor x, Tensor tiles, Tensor w_scale, Tensor smooth, Tensor? bias, "
      "ScalarType out_dtype) -> Tensor");
  m.def("amx_int8_available() -> bool", &kiln_cpu::amx_int8_usable);
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("w8a8_amx_linear", &w8a8_amx_linear); }
