// GGUF blocks as ggml lays them out: the type ids the native ops take, each type's block shape, and
// K-quant blocks read one weight at a time (the 256-weight super-blocks of Q4_K: d, dmin, 12 scale
// bytes, 128 nibble bytes; Q5_K: the same with 32 bytes of fifth bits before the nibbles; Q6_K: 128
// bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d). Shared by cpu_kquants_decode.h (the
// K-quant kernels' parts tables and unpacking), cpu_kquants_a8.cpp (the scalar reads in builds without
// AVX2) and cpu_gguf_rows.cpp.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace kiln_cpu {

// GGML's type ids (kiln.quant.gguf_blocks.GGML_TYPE_IDS)
constexpr int64_t kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ8_0 = 8, kGgmlQ4K = 12, kGgmlQ5K = 13, kGgmlQ6K = 14;

struct GgufBlock {
  int64_t weights, bytes;
};

// a type's block: weights and bytes ({0, 0} for a type not listed here)
inline GgufBlock gguf_block(int64_t type) {
  switch (type) {
    case kGgmlQ4_0: return {32, 18};
    case kGgmlQ4_1: return {32, 20};
    case kGgmlQ8_0: return {32, 34};
    case kGgmlQ4K: return {256, 144};
    case kGgmlQ5K: return {256, 176};
    case kGgmlQ6K: return {256, 210};
    default: return {0, 0};
  }
}

// the float16 at p, as float32
inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 scale bytes s (ggml's get_scale_min_k4)
inline void k4_scale_min(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K (High false: 0..15) / Q5_K (High true: 0..31) block b: weight i's quant, in sub-block i / 32.
// The nibble bytes hold sub-block 2k in their low nibbles and 2k + 1 in their high ones; Q5_K's bit j
// of byte l (after the scales) is weight l of sub-block j's fifth bit.
template <bool High>
inline int k4_quant(const uint8_t* b, int i) {
  const int j = i / 32, l = i % 32;
  const uint8_t byte = b[(High ? 48 : 16) + 32 * (j / 2) + l];
  int q = j % 2 ? byte >> 4 : byte & 15;
  if (High) q |= ((b[16 + l] >> j) & 1) << 4;
  return q;
}

// Q6_K block b: weight i's quant less 32 (-32..31); its scale is the int8 at b[192 + i / 16]. Per half
// (128 weights), weight l + 32 t is byte l + 32 (t & 1)'s low (t < 2) or high nibble with bits 2t,
// 2t + 1 of high byte l above it.
inline int q6_k_quant(const uint8_t* b, int i) {
  const int h = i / 128, t = (i % 128) / 32, l = i % 32;
  const uint8_t* ql = b + 64 * h;
  const uint8_t* qh = b + 128 + 32 * h;
  const int nibble = t < 2 ? ql[l + 32 * (t & 1)] & 15 : ql[l + 32 * (t & 1)] >> 4;
  return (nibble | (((qh[l] >> (2 * t)) & 3) << 4)) - 32;
}

}  // namespace kiln_cpu
