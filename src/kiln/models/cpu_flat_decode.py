"""One-row CPU decode through a Llama-family or Gemma 3 model's layers as one flat loop over its kernels.

An eager decode step of a small model on the CPU spends about a third of its time between kernels:
per layer ~10 module calls, public `kiln.ops` functions and dispatch (SmolLM2-135M on a 2-core AVX2
EPYC: ~3.5 ms of a 12.5 ms step). For a step of one sequence, `FlatDecodeLayers` runs the same layers
as one Python loop that calls what those modules end up calling, with every argument bound once at
start: Kiln's native CPU ops for the norms, RoPE, the KV write and paged attention
(torch.ops.kiln_cpu.*), silu_and_mul's or gelu_tanh_and_mul's CPU implementation, and the
prepared_linear CPU kernel of each weight's layout (kiln.ops.gemm.prepared_linear.cpu.KERNELS). Same
kernels, same order, same arguments, so the same floats as the module path (the tests compare
logprobs bit for bit).

`FlatDecodeLayers.build(model, kv_caches)` returns None (the model keeps its module path) unless every
layer is either a plain pre-norm `DecoderLayer` with `PagedAttention` (Llama, Qwen2, Mistral's sliding
window as paged decode's, Qwen3's per-head q/k norm fused with RoPE as qk_norm_rope's CPU form runs it)
and a SiLU `GatedMLP`, or a `Gemma3DecoderLayer` (four (1 + w) norms, `QKNormRotary`'s per-head q/k
norm before RoPE, its layer's sliding window or none, a GeGLU `GatedMLP`), with NeoX RoPE, no tensor
parallelism, float32 norms and activations, float32, bfloat16 or float16 KV caches without scales,
shifts or exact copies, and the native library serves paged decode at this head dim and cache dtype.
`KILN_CPU_FLAT_DECODE=0` turns it off. The model's forward_layers uses it for decode-only steps of one
token outside torch.compile (the compiled step traces the modules) unless KILN_BACKEND forces an
implementation.

Where every linear's layout is a GGUF-block one with a native one-row kernel (`NATIVE_LAYOUTS`: the
embedded model's default q4_blocks / q8_blocks, their _a8 forms, Q5_K's q8_blocks with mins,
q4_blocks_w8a8's blocks, up to the rows its blocks serve, and a K-quant file's kquants_a8 / kquants) the whole
loop runs as one native call, `torch.classes.kiln_cpu.FlatDecode` (cpu_flat_decode.cpp): the same C++
functions in the same order, without the Python and dispatch between them. It also takes batched decode
steps (one token of each of up to `FlatDecodeLayers.max_rows` sequences: 32, or 64 for Q4 layers on
AVX-512 builds, KQUANTS_ROWS where every linear takes any row count: kquants_a8, kquants, or an exact blocks
layout whose many-row calls run the panel kernel on its blocks), whose linears then run the blocks'
multi-row kernels, as the modules do. `KILN_CPU_FLAT_DECODE=python` keeps
the loop in Python (one token; to compare the two).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kiln.models.gemma3 import NORM_WEIGHT_OFFSET, Gemma3DecoderLayer, QKNormRotary
from kiln.models.layers.attention import PagedAttention
from kiln.models.layers.mlp import GATED_ACTIVATIONS, GatedMLP
from kiln.models.layers.rotary import RotaryEmbedding
from kiln.models.llama import DecoderLayer
from kiln.ops import native_cpu
from kiln.ops.activation.gelu_tanh_and_mul.cpu import gelu_tanh_and_mul_cpu
from kiln.ops.activation.silu_and_mul.cpu import silu_and_mul_cpu
from kiln.ops.attention.paged_decode_attention import cpu_native as paged_decode_native
from kiln.ops.attention.write_kv_cache.cpu import NATIVE_CACHE_DTYPES
from kiln.ops.gemm import cpu_kquants
from kiln.ops.gemm.cpu_block_tiles import NO_TILES
from kiln.ops.gemm.prepared_linear.cpu import KERNELS
from kiln.ops.gemm.quantized_layouts import run_quantized
from kiln.ops.gemm.weight_formats import exact_rows
from kiln.ops.registry import declare_call, env_backend, observing
from kiln.ops.rope.qk_norm_rope.cpu import qk_norm_rope_cpu

F32 = torch.float32

# layouts whose one-row kernel FlatDecode calls natively -> (its kind there, how many of the layout's
# tensors that kernel reads: the blocks' values and scales (and mins), before the float32 copy and the
# tiles, the native_cpu.blocks_tiles_rows kind of its tiles: None where the layout keeps none)
NATIVE_LAYOUTS = {
    "q4_blocks_onednn": (0, 3, "q4"),
    "q8_blocks_onednn": (1, 2, "q8"),
    "q4_blocks_a8_onednn": (2, 3, "q4"),
    "q8_blocks_a8_onednn": (3, 2, "q8"),
    "q4_blocks_w8a8_packed": (0, 3, "q4"),
    "q8_blocks_mins_onednn": (4, 3, None),  # GGUF Q5_K: values, scales and mins, the Q8 kernels'
    "q8_blocks_mins_a8_onednn": (5, 3, None),  # the same with a one-row x quantized to Q8_0
    "kquants_a8": (6, 2, None),  # a K-quant weight's file blocks and parts table: any row count
    "kquants": (7, 2, None),  # the same, exact: its row kernel, then the panel kernel, any row count
}
# of those, the W8A8 hybrids: their rows beyond weight_formats.exact_rows run W8A8, which has no native
# form here, so the native call gets their blocks and no tiles, and takes up to exact_rows rows
HYBRID_LAYOUTS = ("q4_blocks_w8a8_packed",)
_NATIVE_KERNELS = {KERNELS[layout]: kind for layout, kind in NATIVE_LAYOUTS.items()}  # the same, by kernel
_KQUANTS = KERNELS["kquants_a8"]
_KQUANTS_EXACT = KERNELS["kquants"]
# the most rows of a native call whose linears all take any count ("kquants_a8", or blocks layouts with
# the panel kernel past their row and tile kernels): a batched decode step's, which the engine's
# scheduler bounds well below this
KQUANTS_ROWS = 1024
_HYBRID_KERNELS = {KERNELS[layout]: layout for layout in HYBRID_LAYOUTS}
# the q/k norm before RoPE (FlatDecode's QKNorm): none; Gemma's rms_norm per head into new tensors, then
# RoPE; Qwen3's qk_norm_rope (its CPU form), the norm and the rotation in place
NO_QK_NORM, HEAD_NORM, QK_NORM_ROPE = 0, 1, 2
# the gated activations' CPU implementations (what GatedMLP's act_and_mul runs on float32) -> (their kind
# in FlatDecode, their op)
_ACTIVATIONS = {silu_and_mul_cpu: (0, "silu_and_mul"), gelu_tanh_and_mul_cpu: (1, "gelu_tanh_and_mul")}


class _LayerArgs(NamedTuple):
    """One layer's bound arguments (the loop unpacks them in this order). A Llama layer's norm_pre_ff,
    norm_post_ff, q_norm and k_norm are None, its norm_offset 0 and window -1; a Gemma 3 layer's
    norm_post normalizes the attention's output alone (the residual joins at norm_pre_ff)."""

    norm_in: torch.Tensor
    norm_post: torch.Tensor
    eps: float
    qkv_kernel: object
    qkv_w: list
    qkv_bias: torch.Tensor | None
    o_kernel: object
    o_w: list
    gate_up_kernel: object
    gate_up_w: list
    gate_up_dtype: torch.dtype
    down_kernel: object
    down_w: list
    q_size: int
    kv_size: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    cos_sin: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    act_and_mul: object  # silu_and_mul_cpu or gelu_tanh_and_mul_cpu: [T, 2 I] -> [T, I]
    norm_offset: float  # every norm's weight offset, q/k norms included (Gemma's 1 + w)
    norm_pre_ff: torch.Tensor | None
    norm_post_ff: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim], per q head before RoPE
    k_norm: torch.Tensor | None
    qk_eps: float
    window: int  # paged decode's sliding window, -1 for none
    qk_norm_kind: int  # NO_QK_NORM, HEAD_NORM or QK_NORM_ROPE


class _Structure(NamedTuple):
    """What differs between the layer kinds the loop runs: their norms, q/k norm, RoPE, activation."""

    norms: tuple  # (input, post-attention, pre-feedforward or None, post-feedforward or None) [hidden]
    norm_offset: float
    qk_norm: tuple  # (q weight, k weight, eps) or (None, None, 0.0)
    rotary: object
    act_and_mul: object
    qk_norm_kind: int  # _LayerArgs.qk_norm_kind


def _structure(layer) -> _Structure | None:
    """A plain Llama layer's or a Gemma 3 layer's parts, or None for any other layer."""
    if type(layer) not in (DecoderLayer, Gemma3DecoderLayer):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not PagedAttention or type(mlp) is not GatedMLP:
        return None
    if type(layer) is DecoderLayer:  # Llama, Qwen2, Mistral (a sliding window: paged decode's), Qwen3
        if mlp.act_and_mul is not GATED_ACTIVATIONS["silu"]:
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm, None, None)
        if attn.qk_norm is None:
            return _Structure(norms, 0.0, (None, None, 0.0), attn.rotary, silu_and_mul_cpu, NO_QK_NORM)
        qk_norm = (*attn.qk_norm, float(attn.qk_norm_eps))  # Qwen3's, fused with RoPE: qk_norm_rope
        return _Structure(norms, 0.0, qk_norm, attn.rotary, silu_and_mul_cpu, QK_NORM_ROPE)
    position = attn.rotary  # Gemma 3's: the per-head q/k norm, then its RoPE
    if type(position) is not QKNormRotary or mlp.act_and_mul is not GATED_ACTIVATIONS["gelu_tanh"]:
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
             layer.post_feedforward_layernorm)  # fmt: skip
    qk_norm = (position.q_norm, position.k_norm, position.eps)
    return _Structure(norms, NORM_WEIGHT_OFFSET, qk_norm, position.rotary, gelu_tanh_and_mul_cpu, HEAD_NORM)


def _layer_args(layer, kv_cache) -> _LayerArgs | None:
    """The bound arguments of one layer's flat step, or None when the layer is not a form it runs."""
    structure = _structure(layer)
    if structure is None:
        return None
    attn, mlp, rotary = layer.self_attn, layer.mlp, structure.rotary
    if type(rotary) is not RotaryEmbedding:
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(getattr(linear, "tp_group", None) is not None for linear in linears):
        return None
    if any(linear.bias is not None for linear in linears[1:]):  # only the QKV bias (Qwen2) is supported
        return None
    if len(kv_cache) < 2 or any(t is not None for t in tuple(kv_cache)[2:]):  # scales, shift, exact copies
        return None
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    # the caches the native KV write takes (paged decode's dtypes are checked below)
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in NATIVE_CACHE_DTYPES:
        return None
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    # the norms the modules' rms_norm runs natively (other dtypes take PyTorch's)
    norms = [w for w in (*structure.norms, *structure.qk_norm[:2]) if w is not None]
    if not all(w.dtype == F32 for w in norms):
        return None
    if rotary.cos_sin_cache.dtype != F32 or not paged_decode_native.ready(attn.head_dim, key_cache.dtype):
        return None
    qkv, o, gate_up, down = (linear.prepared for linear in linears)
    if any(KERNELS[w.layout] is run_quantized for w in (qkv, o, gate_up, down)):
        return None  # the quantized checkpoint layouts' runner takes other arguments
    qkv_bias = attn.qkv_proj.bias
    if qkv_bias is not None and qkv_bias.dtype != F32:
        return None
    norm_in, norm_post, norm_pre_ff, norm_post_ff = structure.norms
    window = -1 if attn.sliding_window is None else int(attn.sliding_window)
    return _LayerArgs(
        norm_in, norm_post, layer.eps,
        KERNELS[qkv.layout], qkv.tensors, qkv_bias, KERNELS[o.layout], o.tensors,
        KERNELS[gate_up.layout], gate_up.tensors, gate_up.compute_dtype or F32,
        KERNELS[down.layout], down.tensors,
        attn.q_size, attn.kv_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
        rotary.cos_sin_cache, key_cache, value_cache,
        structure.act_and_mul, structure.norm_offset, norm_pre_ff, norm_post_ff, *structure.qk_norm, window,
        structure.qk_norm_kind,
    )  # fmt: skip


def _native_decode(args: list[_LayerArgs]):
    """torch.classes.kiln_cpu.FlatDecode over the layers bound in `args`, or None when a linear's kernel
    has no native form (`NATIVE_LAYOUTS`) or gate_up computes in another dtype."""
    tensors, ints, floats = [], [], []
    for a in args:
        linears = ((a.qkv_kernel, a.qkv_w), (a.o_kernel, a.o_w), (a.gate_up_kernel, a.gate_up_w),
                   (a.down_kernel, a.down_w))  # fmt: skip
        if any(kernel not in _NATIVE_KERNELS for kernel, _ in linears):
            return None
        if a.gate_up_dtype != F32:  # gate_up's output is down's input as is
            return None
        # Gemma's: the pre-feedforward norm, then the post-feedforward one (none without the first)
        ff_norms = [w for w in (a.norm_pre_ff, a.norm_post_ff) if w is not None]
        tensors += [a.norm_in, a.norm_post, a.cos_sin, a.key_cache, a.value_cache]
        tensors += [] if a.qkv_bias is None else [a.qkv_bias]
        tensors += ff_norms + ([a.q_norm, a.k_norm] if a.qk_norm_kind != NO_QK_NORM else [])
        for kernel, weight in linears:  # the blocks' tensors, then the layout's tiles (not the copy)
            blocks = _NATIVE_KERNELS[kernel][1]
            tensors += [
                *weight[:blocks],
                *(NO_TILES if kernel in _HYBRID_KERNELS else weight[blocks + 1 :]),
            ]
        ints += [_NATIVE_KERNELS[kernel][0] for kernel, _ in linears]
        ints += [int(a.qkv_bias is not None), a.q_size, a.kv_size, a.heads, a.kv_heads, a.head_dim]
        hybrid = any(kernel in _HYBRID_KERNELS for kernel, _ in linears)
        # from this many rows each linear's tile kernel (a hybrid's layer: never the tiles)
        ints += [0 if hybrid else _tiles_rows(k, w)[0] for k, w in linears]
        ints += [len(ff_norms), a.qk_norm_kind, _ACTIVATIONS[a.act_and_mul][0], a.window]
        ints += [0 if hybrid else _panel_rows(k, w) for k, w in linears]  # from these rows: the panel
        floats += [float(a.eps), float(a.scale), float(a.norm_offset), float(a.qk_eps)]
    return torch.classes.kiln_cpu.FlatDecode(tensors, ints, floats)


def _native_rows(args: list[_LayerArgs]) -> int:
    """The most rows the native call takes: the fewest that any linear's several-row kernels take as
    prepared_linear routes them (each up to the larger of native_cpu.blocks_gemm_rows() and its tile
    kernel's last row where this build and its layout have one; a HYBRID_LAYOUTS one up to its
    exact_rows; "kquants_a8" ones take any count), so that each row count runs the modules' kernels
    (the native Linear has no upper bound of its own: it relies on this one)."""
    linears = [
        pair
        for a in args
        for pair in ((a.qkv_kernel, a.qkv_w), (a.o_kernel, a.o_w), (a.gate_up_kernel, a.gate_up_w),
                     (a.down_kernel, a.down_w))
    ]  # fmt: skip
    hybrid = [exact_rows(_HYBRID_KERNELS[k], w) for k, w in linears if k in _HYBRID_KERNELS]
    if hybrid:
        return min(hybrid)
    gemm_rows = native_cpu.blocks_gemm_rows()
    bounded = [
        max(gemm_rows, _tiles_rows(kernel, w)[1])
        for kernel, w in linears
        if kernel not in (_KQUANTS, _KQUANTS_EXACT) and not _panel_rows(kernel, w)
    ]
    return min(bounded, default=KQUANTS_ROWS)


def _panel_rows(kernel, weight) -> int:
    """From how many rows a NATIVE_LAYOUTS linear runs the panel kernel on its blocks, as prepared_linear
    routes them (past blocks_gemm_rows() and its tile kernel's rows, where the layout keeps no float32
    copy: native_cpu.blocks_panel_runs()); 0 where it never does (kquants_a8: its own kernel)."""
    if kernel is _KQUANTS:
        return 0
    if kernel is _KQUANTS_EXACT:  # past its row kernel, as kquants_matmul routes them
        return cpu_kquants.rows_kernel_max() + 1
    blocks = _NATIVE_KERNELS[kernel][1]
    if weight[blocks].numel():  # the float32 copy: oneDNN past the blocks' kernels, not native here
        return 0
    return max(native_cpu.blocks_gemm_rows(), _tiles_rows(kernel, weight)[1]) + 1


def _tiles_rows(kernel, weight) -> tuple[int, int]:
    """The rows a NATIVE_LAYOUTS linear's tile kernel takes (native_cpu.blocks_tiles_rows), (0, 0) when
    its layout holds no tiles (Q5_K's "q8_blocks_mins_onednn": no tile kernel takes mins; Q6_K's values
    in "q8_blocks_onednn": none reads blocks of 16)."""
    _, blocks, kind = _NATIVE_KERNELS[kernel]
    if kind is None:
        return 0, 0
    tiles = weight[blocks + 1]  # after the blocks' tensors and the float32 copy
    return native_cpu.blocks_tiles_rows(kind) if tiles.numel() else (0, 0)


class FlatDecodeLayers:
    """The layers of a Llama-family or Gemma 3 model for decode steps of one token on the CPU (module
    docstring).

    Call with forward_layers' arguments for T tokens of a decode-only step (T = 1, or up to
    `max_rows` through the native call: `applies`): positions [T], hidden [T, hidden]
    float32, residual [T, hidden] or None, kv_caches (the ones it was built with), attn_metadata ->
    (hidden, residual) after the last layer, as the modules give them.
    """

    def __init__(self, layers: list[_LayerArgs], kv_caches, native, layouts: list[tuple]):
        self.layers = layers
        self.kv_caches = kv_caches
        # per layer: the qkv, o, gate_up and down weights' layouts, then gate_up's out-features (what a
        # profile needs to name the calls the loop makes: `_declare_calls`)
        self.layouts = layouts
        self.native = native  # torch.classes.kiln_cpu.FlatDecode, or None: the loop below
        self.max_rows = 1 if native is None else _native_rows(layers)

    @classmethod
    def build(cls, model, kv_caches) -> FlatDecodeLayers | None:
        """The flat loop over `model.layers` with these KV caches, or None where it does not apply."""
        mode = os.environ.get("KILN_CPU_FLAT_DECODE", "1")
        if mode == "0" or not native_cpu.load():
            return None
        paged_decode_native.load()
        layers = getattr(model, "layers", None)
        if not layers or len(layers) != len(kv_caches):
            return None
        args = [_layer_args(layer, kv) for layer, kv in zip(layers, kv_caches, strict=True)]
        if any(a is None for a in args):
            return None
        layouts = [
            (
                layer.self_attn.qkv_proj.prepared.layout,
                layer.self_attn.o_proj.prepared.layout,
                layer.mlp.gate_up_proj.prepared.layout,
                layer.mlp.down_proj.prepared.layout,
                layer.mlp.gate_up_proj.prepared.shape[0],
            )
            for layer in layers
        ]
        return cls(args, kv_caches, None if mode == "python" else _native_decode(args), layouts)

    def applies(self, hidden: torch.Tensor, kv_caches, attn_metadata) -> bool:
        """Whether this step may run flat: float32 tokens of a decode-only step, one (or, through the
        native call, up to `max_rows`: the rows its multi-row kernels take), eager,
        on the caches the loop was built with, no implementation forced by KILN_BACKEND (the modules
        honour it; the loop calls the CPU kernels)."""
        return hidden.dtype == F32 and self.takes(hidden.shape[0], kv_caches, attn_metadata)

    def takes(self, rows: int, kv_caches, attn_metadata) -> bool:
        """`applies` for a step of `rows` float32 tokens (the engine asks before choosing its path)."""
        return (
            rows <= self.max_rows
            and env_backend() is None
            and attn_metadata.decode_only
            and attn_metadata.exact_block_tables is None
            and kv_caches is self.kv_caches
            and not torch.compiler.is_compiling()
        )

    def __call__(self, positions, hidden, residual, kv_caches, attn_metadata):
        positions, slots = positions.long(), attn_metadata.slot_mapping.long()
        block_tables, seq_lens = attn_metadata.block_tables, attn_metadata.seq_lens
        if observing():  # the profiler's own time, under a name that says so
            with torch.profiler.record_function("kiln.profile: declaring the flat decode's op calls"):
                self._declare_calls(positions, hidden, residual, slots, block_tables, seq_lens)
        if self.native is not None:
            return self.native.forward(positions, hidden, residual, slots, block_tables, seq_lens)
        ops = torch.ops.kiln_cpu
        for (
            norm_in, norm_post, eps, qkv_kernel, qkv_w, qkv_bias, o_kernel, o_w, gate_up_kernel, gate_up_w,
            gate_up_dtype, down_kernel, down_w, q_size, kv_size, heads, kv_heads, head_dim, scale, cos_sin,
            key_cache, value_cache, act_and_mul, offset, norm_pre_ff, norm_post_ff, q_norm, k_norm, qk_eps,
            window, qk_norm_kind,
        ) in self.layers:  # fmt: skip
            if residual is None:
                residual = hidden
                hidden = ops.rms_norm(hidden, norm_in, eps, None, offset)
            else:
                hidden = ops.rms_norm(hidden, norm_in, eps, residual, offset)
            qkv = qkv_kernel(hidden, qkv_w, qkv_bias, F32)
            q = qkv[:, :q_size].view(1, heads, head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(1, kv_heads, head_dim)
            v = qkv[:, q_size + kv_size :].view(1, kv_heads, head_dim)
            if qk_norm_kind == QK_NORM_ROPE:  # Qwen3: in place, as PagedAttention's op call
                qk_norm_rope_cpu(positions, q, k, q_norm, k_norm, cos_sin, qk_eps, True)
            else:
                if qk_norm_kind == HEAD_NORM:  # Gemma's QKNormRotary: new tensors, which RoPE rotates
                    q = ops.rms_norm(q.reshape(heads, head_dim), q_norm, qk_eps, None, offset).view(q.shape)
                    k = ops.rms_norm(k.reshape(kv_heads, head_dim), k_norm, qk_eps, None, offset)
                    k = k.view(1, kv_heads, head_dim)
                ops.rotary_embedding_(positions, q, k, cos_sin, True)
            ops.write_kv_cache(k, v, key_cache, value_cache, slots)
            # a 16-bit cache: q rounds to its dtype and the output comes back to float32, as PagedAttention
            q = q if key_cache.dtype == F32 else q.to(key_cache.dtype)
            out = ops.paged_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, window)
            hidden = o_kernel(out.view(1, q_size).to(F32), o_w, None, F32)
            if norm_pre_ff is None:
                hidden = ops.rms_norm(hidden, norm_post, eps, residual, offset)
            else:  # Gemma: the attention's output is normalized before it joins the residual stream
                hidden = ops.rms_norm(hidden, norm_post, eps, None, offset)
                hidden = ops.rms_norm(hidden, norm_pre_ff, eps, residual, offset)
            # as GatedMLP: gate_up's output stays in its layout's compute dtype (fp16 for "fp16_*")
            gate_up = gate_up_kernel(hidden, gate_up_w, None, gate_up_dtype)
            hidden = down_kernel(act_and_mul(gate_up), down_w, None, F32)
            if norm_post_ff is not None:
                hidden = ops.rms_norm(hidden, norm_post_ff, eps, None, offset)
        return hidden, residual

    def _declare_calls(self, positions, hidden, residual, slots, block_tables, seq_lens) -> None:
        """Tell a running profile which op calls this step makes (kiln.ops.registry.declare_call): the
        loop runs their kernels without the public functions, which would have declared them. Shapes
        only: the activations are meta tensors."""
        t = hidden.shape[0]

        def meta(*shape, dtype=F32):
            return torch.empty(shape, dtype=dtype, device="meta")

        for a, (qkv, o, gate_up, down, gate_up_size) in zip(self.layers, self.layouts, strict=True):
            x = meta(t, a.norm_in.shape[0])
            declare_call("rms_norm", x, a.norm_in, a.eps, None if residual is None else x, a.norm_offset)
            residual = x
            declare_call("prepared_linear", x, qkv, list(a.qkv_w), a.qkv_bias)
            q, k = meta(t, a.heads, a.head_dim), meta(t, a.kv_heads, a.head_dim)
            if a.qk_norm_kind == QK_NORM_ROPE:
                declare_call("qk_norm_rope", positions, q, k, a.q_norm, a.k_norm, a.cos_sin, a.qk_eps, True)
            else:
                if a.qk_norm_kind == HEAD_NORM:
                    for heads, weight in ((a.heads, a.q_norm), (a.kv_heads, a.k_norm)):
                        rows = meta(t * heads, a.head_dim)
                        declare_call("rms_norm", rows, weight, a.qk_eps, None, a.norm_offset)
                declare_call("rotary_embedding", positions, q, k, a.cos_sin)
            declare_call("write_kv_cache", k, k, a.key_cache, a.value_cache, slots)
            q = meta(t, a.heads, a.head_dim, dtype=a.key_cache.dtype)
            window = None if a.window < 0 else a.window
            declare_call(
                "paged_decode_attention", q, a.key_cache, a.value_cache, block_tables, seq_lens,
                sliding_window=window,
            )  # fmt: skip
            declare_call("prepared_linear", meta(t, a.q_size), o, list(a.o_w))
            if a.norm_pre_ff is None:
                declare_call("rms_norm", x, a.norm_post, a.eps, x, a.norm_offset)
            else:
                declare_call("rms_norm", x, a.norm_post, a.eps, None, a.norm_offset)
                declare_call("rms_norm", x, a.norm_pre_ff, a.eps, x, a.norm_offset)
            declare_call("prepared_linear", x, gate_up, list(a.gate_up_w))
            declare_call(_ACTIVATIONS[a.act_and_mul][1], meta(t, gate_up_size, dtype=a.gate_up_dtype))
            act = meta(t, gate_up_size // 2, dtype=a.gate_up_dtype)
            declare_call("prepared_linear", act, down, list(a.down_w))
            if a.norm_post_ff is not None:
                declare_call("rms_norm", x, a.norm_post_ff, a.eps, None, a.norm_offset)
