// The native CPU KV-cache write of write_kv_cache's "cpu" implementation (cpu.py) for float32 data and
// float32, bfloat16 or float16 caches (16-bit: each value rounded to nearest-even, as Tensor.to): row t
// of key / value ([T, Hkv, D], dense last dim, any token and head strides: views
// of a fused QKV output) is copied to slot slot_mapping[t] of the contiguous caches [num_blocks,
// block_size, Hkv, D]; a negative slot (padding) writes nothing. One call and no host synchronisation,
// where the tensor form filters the padding (a .all() read back) and calls index_copy_ per cache.
// Registered as torch.ops.kiln_cpu.write_kv_cache.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "native_cpu_ops.h"

namespace {

void check_data(const char* name, const at::Tensor& t, const at::Tensor& cache) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(1) == cache.size(2) &&
                  t.size(2) == cache.size(3) && t.stride(2) == 1,
              "kiln_cpu.write_kv_cache: ", name, " must be float32 [T, ", cache.size(2), ", ", cache.size(3),
              "] with a dense last dim, got ", t.scalar_type(), " ", t.sizes(), " strides ", t.strides());
}

}  // namespace

namespace kiln_cpu {

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                    const at::Tensor& slot_mapping) {
  for (const at::Tensor* cache : {&key_cache, &value_cache}) {
    const auto type = cache->scalar_type();
    TORCH_CHECK((type == at::kFloat || type == at::kBFloat16 || type == at::kHalf) && cache->dim() == 4 &&
                    cache->is_contiguous() && type == key_cache.scalar_type(),
                "kiln_cpu.write_kv_cache: caches must be contiguous float32, bfloat16 or float16 [num_blocks, "
                "block_size, Hkv, D] of one dtype, got ",
                cache->scalar_type(), " ", cache->sizes());
  }
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "kiln_cpu.write_kv_cache: key_cache ", key_cache.sizes(),
              " and value_cache ", value_cache.sizes(), " differ");
  check_data("key", key, key_cache);
  check_data("value", value, key_cache);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "kiln_cpu.write_kv_cache: slot_mapping must be int64 [T] with T = ", key.size(0),
              " rows of key and value, got ", slot_mapping.scalar_type(), " ", slot_mapping.sizes(), " and ",
              value.size(0), " value rows");
  const int64_t tokens = key.size(0), heads = key.size(1), d = key.size(2);
  const int64_t slots = key_cache.size(0) * key_cache.size(1), row = heads * d;
  const at::Tensor sc = slot_mapping.contiguous();
  const int64_t* slot = sc.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] < slots, "kiln_cpu.write_kv_cache: slot ", slot[t], " of token ", t,
                " is outside the cache's ", slots, " slots (negative: padding)");
  }
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "write_kv_cache", [&] {
    scalar_t* kc = key_cache.data_ptr<scalar_t>();
    scalar_t* vc = value_cache.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (slot[t] < 0) continue;
        for (int64_t h = 0; h < heads; ++h) {
          at::vec::convert(kp + t * key.stride(0) + h * key.stride(1), kc + slot[t] * row + h * d, d);
          at::vec::convert(vp + t * value.stride(0) + h * value.stride(1), vc + slot[t] * row + h * d, d);
        }
      }
    });
  });
}

}  // namespace kiln_cpu

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("write_kv_cache", &kiln_cpu::write_kv_cache); }
