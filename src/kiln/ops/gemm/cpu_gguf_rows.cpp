// Rows of a GGUF-quantized table decoded on demand (kiln.ops.gemm.cpu_gguf_rows): an embedding lookup
// that keeps the file's blocks instead of a float32 copy of the table. Each value is ggml's float32
// decode, bit for bit (`gguf.quants.dequantize`, Kiln's dequantize_blocks):
//
//   Q8_0  d q              Q4_0  (q - 8) d          Q4_1  q d + m
//   Q4_K  (d sc) q - (dmin m), q 4 bits      Q5_K  the same, q 5 bits      Q6_K  (d sc) (q - 32)
//
// with each product rounded to float32 before the sum: this file is compiled without floating-point
// contraction, so the compiler never fuses a product and a sum into one FMA (one rounding, another
// value). Registered as torch.ops.kiln_cpu.gguf_rows.

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_gguf_fields.h"

#include <cstdint>

namespace {

using kiln_cpu::kGgmlQ4_0, kiln_cpu::kGgmlQ4_1, kiln_cpu::kGgmlQ8_0, kiln_cpu::kGgmlQ4K, kiln_cpu::kGgmlQ5K,
    kiln_cpu::kGgmlQ6K;
using kiln_cpu::fp16_at;

void decode_block(int64_t qtype, const uint8_t* b, float* y) {
  switch (qtype) {
    case kGgmlQ8_0: {
      const float d = fp16_at(b);
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
      return;
    }
    case kGgmlQ4_0: {
      const float d = fp16_at(b);
      for (int i = 0; i < 16; ++i) {
        y[i] = static_cast<float>((b[2 + i] & 15) - 8) * d;
        y[i + 16] = static_cast<float>((b[2 + i] >> 4) - 8) * d;
      }
      return;
    }
    case kGgmlQ4_1: {
      const float d = fp16_at(b), m = fp16_at(b + 2);
      for (int i = 0; i < 16; ++i) {
        y[i] = static_cast<float>(b[4 + i] & 15) * d + m;
        y[i + 16] = static_cast<float>(b[4 + i] >> 4) * d + m;
      }
      return;
    }
    case kGgmlQ4K:
    case kGgmlQ5K: {
      const float d = fp16_at(b), dmin = fp16_at(b + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        kiln_cpu::k4_scale_min(j, b + 4, &sc, &m);
        const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
        for (int i = 32 * j; i < 32 * j + 32; ++i) {
          const int q = qtype == kGgmlQ5K ? kiln_cpu::k4_quant<true>(b, i) : kiln_cpu::k4_quant<false>(b, i);
          y[i] = d1 * static_cast<float>(q) - m1;
        }
      }
      return;
    }
    case kGgmlQ6K: {
      const float d = fp16_at(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int i = 0; i < 256; ++i) {
        const float scale = d * static_cast<float>(sc[i / 16]);
        y[i] = scale * static_cast<float>(kiln_cpu::q6_k_quant(b, i));
      }
      return;
    }
    default: return;
  }
}

}  // namespace

namespace kiln_cpu {

at::Tensor gguf_rows(const at::Tensor& blocks, const at::Tensor& ids, int64_t qtype) {
  const char* op = "gguf_rows";
  const kiln_cpu::GgufBlock shape = kiln_cpu::gguf_block(qtype);
  TORCH_CHECK(shape.weights > 0, op, ": GGML type ", qtype,
              " has no native decode; it takes Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q5_K (13) and Q6_K (14)");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.size(1) % shape.bytes == 0,
              op, ": blocks must be uint8 [V, row_bytes] on the CPU, row_bytes a multiple of ", shape.bytes,
              " (type ", qtype, "), got ", blocks.scalar_type(), " ", blocks.sizes(), " on ", blocks.device());
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1, op,
              ": ids must be int64 [T] on the CPU, got ", ids.scalar_type(), " ", ids.sizes(), " on ", ids.device());
  const int64_t rows = blocks.size(0), per_row = blocks.size(1) / shape.bytes, t = ids.size(0);
  const at::Tensor bc = blocks.contiguous(), ic = ids.contiguous();
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < rows, op, ": id ", ip[r], " at ", r, " is outside the table's ", rows,
                " rows");
  }
  at::Tensor y = at::empty({t, per_row * shape.weights}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = bp + ip[r] * blocks.size(1);
      for (int64_t k = 0; k < per_row; ++k) {
        decode_block(qtype, row + k * shape.bytes, yp + (r * per_row + k) * shape.weights);
      }
    }
  });
  return y;
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) { m.def("gguf_rows(Tensor blocks, Tensor ids, int qtype) -> Tensor"); }

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("gguf_rows", &kiln_cpu::gguf_rows); }
