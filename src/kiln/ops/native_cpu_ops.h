// The C++ entry points of Kiln's native CPU ops (kiln.ops.native_cpu), each registered under
// torch.ops.kiln_cpu by its own source file. Declared here so that a kernel built into the same
// library (the flat one-token decode, kiln/models/cpu_flat_decode.cpp) calls them directly, without a
// trip through Python or the dispatcher per call. Arguments and checks: each definition.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace kiln_cpu {

// norm/rms_norm/rms_norm_cpu.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual, double weight_offset);
// rope/rotary_embedding/rotary_embedding_cpu.cpp
void rotary_embedding_(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos_sin_cache,
                       bool is_neox);
// attention/write_kv_cache/write_kv_cache_cpu.cpp
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                    const at::Tensor& slot_mapping);
// attention/cpu_causal_attention.cpp
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            int64_t window);
bool causal_attention_head_dim(int64_t head_dim);
// attention/paged_decode_attention/cpu_native.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window);
at::Tensor paged_decode_fp8(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            int64_t window, const at::Tensor& k_scale, const at::Tensor& v_scale,
                            const std::optional<at::Tensor>& exact_key_cache,
                            const std::optional<at::Tensor>& exact_value_cache,
                            const std::optional<at::Tensor>& exact_block_tables, int64_t exact_window);
// activation/silu_and_mul/silu_and_mul_cpu.cpp, activation/gelu_tanh_and_mul/gelu_tanh_and_mul_cpu.cpp
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
// gemm/cpu_q4_blocks.cpp, gemm/cpu_q8_blocks.cpp, gemm/cpu_blocks_a8.cpp
at::Tensor q4_blocks_gemv(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                          const at::Tensor& mins);
at::Tensor q4_blocks_gemm(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                          const at::Tensor& mins);
// mins: float32, the scales' shape (Q5_K's per 32, a stacked weight's per 16 or 32), or none
at::Tensor q8_blocks_gemv(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins = std::nullopt);
at::Tensor q8_blocks_gemm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins = std::nullopt);
std::tuple<at::Tensor, at::Tensor> quantize_q8_0(const at::Tensor& x);
at::Tensor q4_blocks_a8_gemv(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                             const at::Tensor& mins);
at::Tensor q8_blocks_a8_gemv(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales);
at::Tensor q8_blocks_mins_a8_gemv(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                                  const at::Tensor& mins);
// gemm/cpu_kquants_a8.cpp: blocks uint8, the parts' rows as their files store them; parts int64 [P, 2]
// (GGML type, rows); n: their rows' sum (the output's width)
// (x [1, K]; the gemm form: x [M, K], each row's outputs as the gemv's for that row alone)
at::Tensor kquants_a8_gemv(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, int64_t n);
at::Tensor kquants_a8_gemm(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, int64_t n);
// gemm/cpu_kquants.cpp: the same blocks and parts, exact float32 (x [M, K]; each row's outputs as alone)
at::Tensor kquants_gemm(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, int64_t n);
// gemm/cpu_block_tiles.cpp, gemm/cpu_q8_tiles.cpp
at::Tensor q4_tiles_gemm(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales, int64_t n);
// gemm/cpu_blocks_panel.cpp
at::Tensor blocks_panel_gemm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                             const std::optional<at::Tensor>& mins);
at::Tensor kquants_panel_gemm(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, int64_t n);
at::Tensor q8_tiles_gemm(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales, int64_t n);

}  // namespace kiln_cpu
