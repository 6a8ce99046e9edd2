// The flat decode of kiln.models.cpu_flat_decode in one native call: every layer of a Llama-family or
// Gemma 3 model for one float32 token of each of T sequences, whose four linears are GGUF-block layouts with
// native kernels (q4_blocks / q8_blocks, exact or with a one-row x quantized to Q8_0, Q5_K's or a stacked
// weight's q8_blocks with mins; several rows through the exact multi-row kernels, as prepared_linear runs
// them; kquants_a8, a K-quant weight's file blocks times x quantized to Q8_K at any row count; kquants,
// the same blocks exact at any row count).
// It calls the same C++ functions the Python loop reaches through torch.ops.kiln_cpu (native_cpu_ops.h),
// in the same order with the same arguments, so the floats are the loop's; what goes is the Python and
// the dispatcher between them (~12 calls a layer, ~1.5 ms a token for SmolLM2's 30 layers on a 2-core
// host).
//
// Registered as the custom class torch.classes.kiln_cpu.FlatDecode, built once per model and KV caches:
//
//   FlatDecode(tensors, ints, floats)   per layer, in order:
//       ints    qkv_kind, o_kind, gate_up_kind, down_kind, has_qkv_bias, q_size, kv_size, heads,
//               kv_heads, head_dim, then the four linears' tiles_rows      (kKindTensors: a kind's count),
//               ff_norms (0: Llama's; 1: Gemma's post-attention norm of the attention alone, then a
//               pre-feedforward norm with the residual; 2: and a post-feedforward norm), qk_norm (QKNorm:
//               0 none, 1 Gemma's per-head norms then RoPE, 2 Qwen3's qk_norm_rope),
//               activation (kSilu / kGeluTanh), window (paged decode's sliding window, -1: none), then
//               the four linears' panel_rows (from this many rows the panel kernel on the blocks,
//               blocks_panel_gemm, as prepared_linear past the row and tile kernels; 0: never)
//       floats  eps, scale, norm_offset (every norm's weight offset: Gemma's 1 + w), qk_eps
//       tensors input_norm [H], post_norm [H], cos_sin_cache [P, R], key_cache, value_cache
//               [blocks, block_size, Hkv, D], qkv bias [Q + 2 KV] if has_qkv_bias, ff_norms norms [H]
//               (pre-, then post-feedforward), q_norm [D] and k_norm [D] if any qk_norm, then the tensors of
//               the qkv, o, gate_up and down weights (as their layouts keep them, less the float32 copy:
//               the blocks' tensors, then the layout's tiles; T >= its tiles_rows > 0 rows run them;
//               the kinds with mins and kquants_a8 (its blocks and parts table) have none)
//   forward(positions int64 [T], hidden float32 [T, H], residual float32 [T, H] or None,
//           slot_mapping int64 [T], block_tables int32 [T, W], seq_lens int32 [T]) -> (hidden, residual)
//   (T sequences of a decode-only step, one token each; the caller keeps T within the multi-row
//   kernels' rows, FlatDecodeLayers.max_rows)
//
// A Llama layer: h = norm_in(h + r); h = attn(h); h = post_norm(h + r); h = mlp(h). A Gemma 3 layer
// (ff_norms 2, qk_norm, kGeluTanh): h = norm_in(h + r); h = post_norm(attn(h)) with each q / k head
// normalized before RoPE; h = mlp(pre_ff_norm(h + r)); h = post_ff_norm(h). A Qwen3 layer is a Llama one
// whose q and k heads are normalized and rotated by qk_norm_rope (qk_norm 2).

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "native_cpu_ops.h"  // kiln/ops, on the include path

#include <optional>
#include <tuple>
#include <vector>

namespace {

// Each kernel call under the profiler's name of its op (no cost while no profiler runs), so that
// `kiln profile --engine` still splits the step by kernel instead of one opaque call.
#define KILN_RECORDED(name, ...)                      \
  do {                                                \
    RECORD_FUNCTION(name, std::vector<c10::IValue>()); \
    __VA_ARGS__;                                      \
  } while (0)

constexpr const char* kKindOps[] = {"kiln_cpu::q4_blocks_gemv",    "kiln_cpu::q8_blocks_gemv",
                                    "kiln_cpu::q4_blocks_a8_gemv", "kiln_cpu::q8_blocks_a8_gemv",
                                    "kiln_cpu::q8_blocks_gemv",    "kiln_cpu::q8_blocks_mins_a8_gemv",
                                    "kiln_cpu::kquants_a8_gemv", "kiln_cpu::kquants_gemm"};
constexpr const char* kKindRowsOps[] = {"kiln_cpu::q4_blocks_gemm", "kiln_cpu::q8_blocks_gemm"};

// kQ8BlocksMins: "q8_blocks_mins_onednn" (Q5_K's, a stacked weight's: the Q8 kernels with their optional
// mins); kQ8BlocksMinsA8: its a8 form ("q8_blocks_mins_a8_onednn"); kKQuantsA8: "kquants_a8" (a K-quant
// weight's file blocks and parts table: cpu_kquants_a8.cpp, every row count); kKQuants: "kquants" (the
// same tensors, exact: cpu_kquants.cpp, the panel kernel from panel_rows)
enum Kind : int64_t {
  kQ4Blocks = 0,
  kQ8Blocks = 1,
  kQ4BlocksA8 = 2,
  kQ8BlocksA8 = 3,
  kQ8BlocksMins = 4,
  kQ8BlocksMinsA8 = 5,
  kKQuantsA8 = 6,
  kKQuants = 7,
  kKinds = 8
};
// the blocks' tensors (nibbles, scales, mins / values, scales), then the tiles and tile scales; the
// kinds with mins: values, scales and mins (no tiles); kKQuantsA8, kKQuants: the blocks and the parts table
constexpr int64_t kKindTensors[kKinds] = {5, 4, 5, 4, 3, 3, 2, 2};
inline bool kquant_kind(int64_t kind) { return kind == kKQuantsA8 || kind == kKQuants; }
inline bool with_mins(int64_t kind) { return kind == kQ8BlocksMins || kind == kQ8BlocksMinsA8; }
constexpr int64_t kInts = 22, kFloats = 4;
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };
// the q/k norm: none; Gemma's (rms_norm per head into new tensors, then RoPE); Qwen3's (qk_norm_rope)
enum QKNorm : int64_t { kNoQKNorm = 0, kHeadNorm = 1, kQKNormRope = 2 };

// qk_norm_rope's "cpu" implementation (rope/qk_norm_rope/cpu.py) on q [T, H, D] and k [T, Hkv, D], views
// into the QKV output, in place (Qwen3's per-head RMSNorm, then NeoX RoPE): the same ATen calls in the same
// order (the op has no native kernel), so the modules' floats
void norm_rotate_(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                  double eps) {
  at::Tensor y = at::rms_norm(x.to(at::kFloat), {x.size(-1)}, weight.to(at::kFloat), eps);  // a new buffer
  const int64_t half = cos.size(-1);
  at::Tensor y1 = y.slice(-1, 0, half), y2 = y.slice(-1, half, 2 * half);
  // y1' goes to a new buffer first, so y2' (computed in place) still reads the original y1
  at::Tensor out1 = (y1 * cos).addcmul_(y2, sin, -1.0);
  y2.mul_(cos).addcmul_(y1, sin);
  y1.copy_(out1);
  x.copy_(y);
}

void qk_norm_rope(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                  const at::Tensor& k_weight, const at::Tensor& cos_sin_cache, double eps) {
  const at::Tensor cos_sin = cos_sin_cache.index_select(0, positions).to(at::kFloat);  // [T, rotary_dim]
  const int64_t half = cos_sin.size(-1) / 2;
  const at::Tensor cos = cos_sin.slice(1, 0, half).unsqueeze(1), sin = cos_sin.slice(1, half).unsqueeze(1);
  norm_rotate_(q, q_weight, cos, sin, eps);
  norm_rotate_(k, k_weight, cos, sin, eps);
}

// x [T, heads * D] (a view into the QKV output) -> [T, heads, D]: rms_norm over each head, a new tensor,
// as Gemma's QKNormRotary calls it on [T * heads, D] rows
at::Tensor head_norm(const at::Tensor& x, int64_t heads, int64_t head_dim, const at::Tensor& weight, double eps,
                     double offset) {
  const int64_t t = x.size(0);
  at::Tensor out;
  KILN_RECORDED("kiln_cpu::rms_norm",
                out = kiln_cpu::rms_norm(x.view({t, heads, head_dim}).reshape({t * heads, head_dim}), weight, eps,
                                         std::nullopt, offset));
  return out.view({t, heads, head_dim});
}

struct Linear {
  int64_t kind;
  std::vector<at::Tensor> w;
  int64_t kquants_rows = 0;  // kKQuantsA8, kKQuants: the output's width (the parts' rows)
  // from this many rows the tile kernel (native_cpu.blocks_tiles_rows(kind); 0: never), up to
  // panel_rows; from panel_rows the panel kernel (0: never, and FlatDecodeLayers.max_rows keeps T within
  // the tile and row kernels' rows)
  int64_t tiles_rows, panel_rows;

  // x [T, K]: one row through the kind's one-row kernel; several (one token of each of T sequences)
  // through the exact multi-row kernels of its blocks, as prepared_linear's "*_blocks[_a8]_onednn"
  // (FlatDecodeLayers keeps T within the rows they take); "kquants_a8" through its kernel at any T
  at::Tensor operator()(const at::Tensor& x) const {
    if (kind == kKQuants) {  // the exact kernels on a K-quant weight's file blocks, any T
      if (panel_rows > 0 && x.size(0) >= panel_rows) {
        RECORD_FUNCTION("kiln_cpu::kquants_panel_gemm", std::vector<c10::IValue>());
        return kiln_cpu::kquants_panel_gemm(x, w[0], w[1], kquants_rows);
      }
      RECORD_FUNCTION(kKindOps[kind], std::vector<c10::IValue>());
      return kiln_cpu::kquants_gemm(x, w[0], w[1], kquants_rows);
    }
    if (kind == kKQuantsA8 && x.size(0) > 1) {
      RECORD_FUNCTION("kiln_cpu::kquants_a8_gemm", std::vector<c10::IValue>());
      return kiln_cpu::kquants_a8_gemm(x, w[0], w[1], kquants_rows);
    }
    if (x.size(0) > 1) {
      const bool q4 = kind == kQ4Blocks || kind == kQ4BlocksA8;
      if (panel_rows > 0 && x.size(0) >= panel_rows) {
        RECORD_FUNCTION("kiln_cpu::blocks_panel_gemm", std::vector<c10::IValue>());
        const bool mins = q4 || with_mins(kind);  // Q4 blocks: their m; Q5_K / stacked: their mins
        return kiln_cpu::blocks_panel_gemm(x, w[0], w[1], mins ? std::optional<at::Tensor>(w[2]) : std::nullopt);
      }
      if (tiles_rows > 0 && x.size(0) >= tiles_rows) {
        RECORD_FUNCTION(q4 ? "kiln_cpu::q4_tiles_gemm" : "kiln_cpu::q8_tiles_gemm", std::vector<c10::IValue>());
        return q4 ? kiln_cpu::q4_tiles_gemm(x, w[3], w[4], w[0].size(0))
                  : kiln_cpu::q8_tiles_gemm(x, w[2], w[3], w[0].size(0));
      }
      RECORD_FUNCTION(kKindRowsOps[q4 ? 0 : 1], std::vector<c10::IValue>());
      if (q4) return kiln_cpu::q4_blocks_gemm(x, w[0], w[1], w[2]);
      if (with_mins(kind)) return kiln_cpu::q8_blocks_gemm(x, w[0], w[1], w[2]);
      return kiln_cpu::q8_blocks_gemm(x, w[0], w[1]);
    }
    RECORD_FUNCTION(kKindOps[kind], std::vector<c10::IValue>());
    switch (kind) {
      case kQ4Blocks: return kiln_cpu::q4_blocks_gemv(x, w[0], w[1], w[2]);
      case kQ8Blocks: return kiln_cpu::q8_blocks_gemv(x, w[0], w[1]);
      case kQ4BlocksA8: return kiln_cpu::q4_blocks_a8_gemv(x, w[0], w[1], w[2]);
      case kQ8BlocksMins: return kiln_cpu::q8_blocks_gemv(x, w[0], w[1], w[2]);
      case kQ8BlocksMinsA8: return kiln_cpu::q8_blocks_mins_a8_gemv(x, w[0], w[1], w[2]);
      case kKQuantsA8: return kiln_cpu::kquants_a8_gemv(x, w[0], w[1], kquants_rows);
      default: return kiln_cpu::q8_blocks_a8_gemv(x, w[0], w[1]);
    }
  }
};

struct Layer {
  at::Tensor norm_in, norm_post, cos_sin, key_cache, value_cache;
  std::optional<at::Tensor> qkv_bias;
  std::optional<at::Tensor> norm_pre_ff, norm_post_ff;  // Gemma's sandwich norms
  std::optional<at::Tensor> q_norm, k_norm;             // [head_dim], each head before RoPE
  Linear qkv, o, gate_up, down;
  int64_t q_size, kv_size, heads, kv_heads, head_dim, activation, window, qk_norm_kind;
  double eps, scale, norm_offset, qk_eps;
};

struct FlatDecode : torch::CustomClassHolder {
  std::vector<Layer> layers;

  FlatDecode(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, std::vector<double> floats) {
    TORCH_CHECK(!ints.empty() && ints.size() % kInts == 0 && floats.size() * kInts == ints.size() * kFloats,
                "kiln_cpu.FlatDecode: ", kInts, " ints and ", kFloats, " floats a layer, got ", ints.size(),
                " and ", floats.size());
    size_t next = 0;
    auto take = [&]() -> at::Tensor {
      TORCH_CHECK(next < tensors.size(), "kiln_cpu.FlatDecode: ", tensors.size(), " tensors are too few");
      return tensors[next++];
    };
    for (size_t l = 0; l < ints.size() / kInts; ++l) {
      const int64_t* in = ints.data() + l * kInts;
      for (int i = 0; i < 4; ++i) {
        TORCH_CHECK(in[i] >= 0 && in[i] < kKinds, "kiln_cpu.FlatDecode: layer ", l, " has weight kind ", in[i]);
      }
      Layer layer;
      layer.norm_in = take();
      layer.norm_post = take();
      layer.cos_sin = take();
      layer.key_cache = take();
      layer.value_cache = take();
      if (in[4] != 0) layer.qkv_bias = take();
      TORCH_CHECK(in[14] >= 0 && in[14] <= 2, "kiln_cpu.FlatDecode: layer ", l, " has ", in[14],
                  " feedforward norms (0 to 2)");
      if (in[14] >= 1) layer.norm_pre_ff = take();
      if (in[14] >= 2) layer.norm_post_ff = take();
      TORCH_CHECK(in[15] >= kNoQKNorm && in[15] <= kQKNormRope, "kiln_cpu.FlatDecode: layer ", l, " has q/k norm kind ",
                  in[15], " (0 to 2)");
      layer.qk_norm_kind = in[15];
      if (in[15] != kNoQKNorm) {
        layer.q_norm = take();
        layer.k_norm = take();
      }
      TORCH_CHECK(in[16] == kSilu || in[16] == kGeluTanh, "kiln_cpu.FlatDecode: layer ", l, " has activation ",
                  in[16]);
      layer.activation = in[16];
      layer.window = in[17];
      for (auto [i, linear] : {std::pair{0, &layer.qkv}, {1, &layer.o}, {2, &layer.gate_up}, {3, &layer.down}}) {
        linear->kind = in[i];
        linear->tiles_rows = in[10 + i];
        linear->panel_rows = in[18 + i];
        TORCH_CHECK(linear->panel_rows == 0 || (in[i] != kKQuantsA8 && linear->panel_rows > 1),
                    "kiln_cpu.FlatDecode: layer ", l, ": weight kind ", in[i], " got panel_rows ",
                    linear->panel_rows, " (kquants_a8: none; else 0 or more than one row)");
        TORCH_CHECK((!with_mins(in[i]) && !kquant_kind(in[i])) || linear->tiles_rows == 0,
                    "kiln_cpu.FlatDecode: layer ", l, ": weight kind ", in[i],
                    " has no tiles (the kinds with mins, kquants_a8 and kquants), got tiles_rows ",
                    linear->tiles_rows);
        for (int64_t t = 0; t < kKindTensors[in[i]]; ++t) linear->w.push_back(take());
        if (kquant_kind(in[i])) {
          const at::Tensor& parts = linear->w[1];
          TORCH_CHECK(parts.scalar_type() == at::kLong && parts.dim() == 2 && parts.size(1) == 2,
                      "kiln_cpu.FlatDecode: layer ", l, ": a K-quant weight's parts must be int64 [P, 2], got ",
                      parts.scalar_type(), " ", parts.sizes());
          linear->kquants_rows = parts.select(1, 1).sum().item<int64_t>();
        }
      }
      layer.q_size = in[5];
      layer.kv_size = in[6];
      layer.heads = in[7];
      layer.kv_heads = in[8];
      layer.head_dim = in[9];
      TORCH_CHECK(layer.heads * layer.head_dim == layer.q_size && layer.kv_heads * layer.head_dim == layer.kv_size,
                  "kiln_cpu.FlatDecode: layer ", l, ": q_size ", layer.q_size, " / kv_size ", layer.kv_size,
                  " are not heads ", layer.heads, " / ", layer.kv_heads, " x head_dim ", layer.head_dim);
      layer.eps = floats[l * kFloats];
      layer.scale = floats[l * kFloats + 1];
      layer.norm_offset = floats[l * kFloats + 2];
      layer.qk_eps = floats[l * kFloats + 3];
      layers.push_back(std::move(layer));
    }
    TORCH_CHECK(next == tensors.size(), "kiln_cpu.FlatDecode: ", tensors.size() - next, " tensors left over");
  }

  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& positions, at::Tensor hidden,
                                             std::optional<at::Tensor> residual, const at::Tensor& slot_mapping,
                                             const at::Tensor& block_tables, const at::Tensor& seq_lens) {
    RECORD_FUNCTION("kiln_cpu::FlatDecode.forward", std::vector<c10::IValue>());
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.size(0) >= 1,
                "kiln_cpu.FlatDecode: hidden must be float32 [T, H], got ", hidden.scalar_type(), " ",
                hidden.sizes());
    const int64_t t = hidden.size(0);
    for (Layer& l : layers) {
      const double offset = l.norm_offset;
      if (residual.has_value()) {
        KILN_RECORDED("kiln_cpu::rms_norm", hidden = kiln_cpu::rms_norm(hidden, l.norm_in, l.eps, residual, offset));
      } else {  // the first layer: the residual stream starts as the embeddings themselves
        residual = hidden;
        KILN_RECORDED("kiln_cpu::rms_norm",
                      hidden = kiln_cpu::rms_norm(hidden, l.norm_in, l.eps, std::nullopt, offset));
      }
      at::Tensor qkv = l.qkv(hidden);
      if (l.qkv_bias.has_value()) qkv.add_(*l.qkv_bias);
      at::Tensor q = qkv.slice(1, 0, l.q_size).view({t, l.heads, l.head_dim});
      at::Tensor k = qkv.slice(1, l.q_size, l.q_size + l.kv_size).view({t, l.kv_heads, l.head_dim});
      at::Tensor v = qkv.slice(1, l.q_size + l.kv_size).view({t, l.kv_heads, l.head_dim});
      if (l.qk_norm_kind == kQKNormRope) {  // Qwen3: in place, into the QKV output
        KILN_RECORDED("kiln::qk_norm_rope", qk_norm_rope(positions, q, k, *l.q_norm, *l.k_norm, l.cos_sin, l.qk_eps));
      } else {
        if (l.qk_norm_kind == kHeadNorm) {  // new tensors, which RoPE then rotates in place
          q = head_norm(qkv.slice(1, 0, l.q_size), l.heads, l.head_dim, *l.q_norm, l.qk_eps, offset);
          k = head_norm(qkv.slice(1, l.q_size, l.q_size + l.kv_size), l.kv_heads, l.head_dim, *l.k_norm, l.qk_eps,
                        offset);
        }
        KILN_RECORDED("kiln_cpu::rotary_embedding_", kiln_cpu::rotary_embedding_(positions, q, k, l.cos_sin, true));
      }
      KILN_RECORDED("kiln_cpu::write_kv_cache",
                    kiln_cpu::write_kv_cache(k, v, l.key_cache, l.value_cache, slot_mapping));
      // a 16-bit cache: q rounds to its dtype and the output comes back to float32, as PagedAttention does
      const bool narrow = l.key_cache.scalar_type() != at::kFloat;
      at::Tensor out;
      KILN_RECORDED("kiln_cpu::paged_decode",
                    out = kiln_cpu::paged_decode(narrow ? q.to(l.key_cache.scalar_type()) : q, l.key_cache,
                                                 l.value_cache, block_tables, seq_lens, l.scale, l.window));
      hidden = l.o((narrow ? out.to(at::kFloat) : out).view({t, l.q_size}));
      if (l.norm_pre_ff.has_value()) {  // Gemma: the attention output is normalized before it joins the stream
        KILN_RECORDED("kiln_cpu::rms_norm",
                      hidden = kiln_cpu::rms_norm(hidden, l.norm_post, l.eps, std::nullopt, offset));
        KILN_RECORDED("kiln_cpu::rms_norm",
                      hidden = kiln_cpu::rms_norm(hidden, *l.norm_pre_ff, l.eps, residual, offset));
      } else {
        KILN_RECORDED("kiln_cpu::rms_norm",
                      hidden = kiln_cpu::rms_norm(hidden, l.norm_post, l.eps, residual, offset));
      }
      at::Tensor gate_up = l.gate_up(hidden);
      if (l.activation == kGeluTanh) {
        KILN_RECORDED("kiln_cpu::gelu_tanh_and_mul", gate_up = kiln_cpu::gelu_tanh_and_mul(gate_up));
      } else {
        KILN_RECORDED("kiln_cpu::silu_and_mul", gate_up = kiln_cpu::silu_and_mul(gate_up));
      }
      hidden = l.down(gate_up);
      if (l.norm_post_ff.has_value()) {
        KILN_RECORDED("kiln_cpu::rms_norm",
                      hidden = kiln_cpu::rms_norm(hidden, *l.norm_post_ff, l.eps, std::nullopt, offset));
      }
    }
    return {hidden, *residual};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.class_<FlatDecode>("FlatDecode")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("forward", &FlatDecode::forward);
}
