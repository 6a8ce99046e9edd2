"""One-row CPU decode through a Llama-family model's layers as one flat loop over its kernels.

An eager decode step of a small model on the CPU spends about a third of its time between kernels:
per layer ~10 module calls, public `kiln.ops` functions and dispatch (SmolLM2-135M on a 2-core AVX2
EPYC: ~3.5 ms of a 12.5 ms step). For a step of one sequence, `FlatDecodeLayers` runs the same layers
as one Python loop that calls what those modules end up calling, with every argument bound once at
start: Kiln's native CPU ops for the norms, RoPE, the KV write and paged attention
(torch.ops.kiln_cpu.*), silu_and_mul's CPU implementation, and the prepared_linear CPU kernel of
each weight's layout (kiln.ops.gemm.prepared_linear.cpu.KERNELS). Same kernels, same order, same
arguments, so the same floats as the module path (the tests compare logprobs bit for bit).

`FlatDecodeLayers.build(model, kv_caches)` returns None (the model keeps its module path) unless every
layer is a plain pre-norm `DecoderLayer` with `PagedAttention` (no q/k norm, no sliding window) and a
SiLU `GatedMLP`, NeoX RoPE, no tensor parallelism, float32 norms and activations, float32, bfloat16
or float16 KV caches without scales, shifts or exact copies, and the native library serves paged
decode at this head dim and cache dtype.
`KILN_CPU_FLAT_DECODE=0` turns it off. The model's forward_layers uses it for decode-only steps of one
token outside torch.compile (the compiled step traces the modules) unless KILN_BACKEND forces an
implementation.

Where every linear's layout is a GGUF-block one with a native one-row kernel (`NATIVE_LAYOUTS`: the
embedded model's default q4_blocks / q8_blocks, their _a8 forms, Q5_K's q8_blocks with mins and
q4_blocks_w8a8's blocks, up to the rows its blocks serve) the whole loop runs as one native
call, `torch.classes.kiln_cpu.FlatDecode` (cpu_flat_decode.cpp): the same C++ functions in the same
order, without the Python and dispatch between them. It also takes batched decode steps (one token of
each of up to `FlatDecodeLayers.max_rows` sequences: 32, or 64 for Q4 layers on AVX-512 builds), whose linears
then run the blocks' exact multi-row kernels, as the modules do. `KILN_CPU_FLAT_DECODE=python` keeps
the loop in Python (one token; to compare the two).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kiln.models.layers.attention import PagedAttention
from kiln.models.layers.mlp import GATED_ACTIVATIONS, GatedMLP
from kiln.models.layers.rotary import RotaryEmbedding
from kiln.models.llama import DecoderLayer
from kiln.ops import native_cpu
from kiln.ops.activation.silu_and_mul.cpu import silu_and_mul_cpu
from kiln.ops.attention.paged_decode_attention import cpu_native as paged_decode_native
from kiln.ops.attention.write_kv_cache.cpu import NATIVE_CACHE_DTYPES
from kiln.ops.gemm.cpu_block_tiles import NO_TILES
from kiln.ops.gemm.prepared_linear.cpu import KERNELS
from kiln.ops.gemm.quantized_layouts import run_quantized
from kiln.ops.gemm.weight_formats import exact_rows
from kiln.ops.registry import declare_call, env_backend, observing

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
}
# of those, the W8A8 hybrids: their rows beyond weight_formats.exact_rows run W8A8, which has no native
# form here, so the native call gets their blocks and no tiles, and takes up to exact_rows rows
HYBRID_LAYOUTS = ("q4_blocks_w8a8_packed",)
_NATIVE_KERNELS = {KERNELS[layout]: kind for layout, kind in NATIVE_LAYOUTS.items()}  # the same, by kernel
_HYBRID_KERNELS = {KERNELS[layout]: layout for layout in HYBRID_LAYOUTS}


class _LayerArgs(NamedTuple):
    """One layer's bound arguments (the loop unpacks them in this order)."""

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


def _layer_args(layer, kv_cache) -> _LayerArgs | None:
    """The bound arguments of one layer's flat step, or None when the layer is not the plain form."""
    if type(layer) is not DecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not PagedAttention or type(mlp) is not GatedMLP:
        return None
    rotary = attn.rotary
    if type(rotary) is not RotaryEmbedding or attn.qk_norm is not None or attn.sliding_window is not None:
        return None
    if mlp.act_and_mul is not GATED_ACTIVATIONS["silu"]:
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
    if not all(w.dtype == F32 for w in (layer.input_layernorm, layer.post_attention_layernorm)):
        return None
    if rotary.cos_sin_cache.dtype != F32 or not paged_decode_native.ready(attn.head_dim, key_cache.dtype):
        return None
    qkv, o, gate_up, down = (linear.prepared for linear in linears)
    if any(KERNELS[w.layout] is run_quantized for w in (qkv, o, gate_up, down)):
        return None  # the quantized checkpoint layouts' runner takes other arguments
    qkv_bias = attn.qkv_proj.bias
    if qkv_bias is not None and qkv_bias.dtype != F32:
        return None
    return _LayerArgs(
        layer.input_layernorm, layer.post_attention_layernorm, layer.eps,
        KERNELS[qkv.layout], qkv.tensors, qkv_bias, KERNELS[o.layout], o.tensors,
        KERNELS[gate_up.layout], gate_up.tensors, gate_up.compute_dtype or F32,
        KERNELS[down.layout], down.tensors,
        attn.q_size, attn.kv_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
        rotary.cos_sin_cache, key_cache, value_cache,
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
        tensors += [a.norm_in, a.norm_post, a.cos_sin, a.key_cache, a.value_cache]
        tensors += [] if a.qkv_bias is None else [a.qkv_bias]
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
        floats += [float(a.eps), float(a.scale)]
    return torch.classes.kiln_cpu.FlatDecode(tensors, ints, floats)


def _native_rows(args: list[_LayerArgs]) -> int:
    """The most rows the native call takes: the fewest that any linear's several-row kernels take as
    prepared_linear routes them (each up to the larger of native_cpu.blocks_gemm_rows() and its tile
    kernel's last row where this build and its layout have one; a HYBRID_LAYOUTS one up to its
    exact_rows), so that each row count runs the modules' kernels (the native Linear has no upper bound
    of its own: it relies on this one)."""
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
    return min(max(gemm_rows, _tiles_rows(kernel, w)[1]) for kernel, w in linears)


def _tiles_rows(kernel, weight) -> tuple[int, int]:
    """The rows a NATIVE_LAYOUTS linear's tile kernel takes (native_cpu.blocks_tiles_rows), (0, 0) when
    its layout holds no tiles (Q5_K's "q8_blocks_mins_onednn": no tile kernel takes mins; Q6_K's values
    in "q8_blocks_onednn": none reads blocks of 16)."""
    kind = _block_kind(kernel)
    if kind is None:
        return 0, 0
    tiles = weight[_NATIVE_KERNELS[kernel][1] + 1]  # after the blocks' tensors and the float32 copy
    return native_cpu.blocks_tiles_rows(kind) if tiles.numel() else (0, 0)


def _block_kind(kernel) -> str | None:
    """ "q4" or "q8": the tile kind of the blocks a NATIVE_LAYOUTS kernel reads (Q4, Q8_0); None for a
    layout that keeps no tiles (Q5_K's with mins)."""
    return _NATIVE_KERNELS[kernel][2]


class FlatDecodeLayers:
    """The layers of a Llama-family model for decode steps of one token on the CPU (module docstring).

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
            key_cache, value_cache,
        ) in self.layers:  # fmt: skip
            if residual is None:
                residual = hidden
                hidden = ops.rms_norm(hidden, norm_in, eps, None, 0.0)
            else:
                hidden = ops.rms_norm(hidden, norm_in, eps, residual, 0.0)
            qkv = qkv_kernel(hidden, qkv_w, qkv_bias, F32)
            q = qkv[:, :q_size].view(1, heads, head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(1, kv_heads, head_dim)
            v = qkv[:, q_size + kv_size :].view(1, kv_heads, head_dim)
            ops.rotary_embedding_(positions, q, k, cos_sin, True)
            ops.write_kv_cache(k, v, key_cache, value_cache, slots)
            # a 16-bit cache: q rounds to its dtype and the output comes back to float32, as PagedAttention
            q = q if key_cache.dtype == F32 else q.to(key_cache.dtype)
            out = ops.paged_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, -1)
            hidden = o_kernel(out.view(1, q_size).to(F32), o_w, None, F32)
            hidden = ops.rms_norm(hidden, norm_post, eps, residual, 0.0)
            # as GatedMLP: gate_up's output stays in its layout's compute dtype (fp16 for "fp16_*")
            gate_up = gate_up_kernel(hidden, gate_up_w, None, gate_up_dtype)
            hidden = down_kernel(silu_and_mul_cpu(gate_up), down_w, None, F32)
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
            declare_call("rms_norm", x, a.norm_in, a.eps, None if residual is None else x)
            residual = x
            declare_call("prepared_linear", x, qkv, list(a.qkv_w), a.qkv_bias)
            q, k = meta(t, a.heads, a.head_dim), meta(t, a.kv_heads, a.head_dim)
            declare_call("rotary_embedding", positions, q, k, a.cos_sin)
            declare_call("write_kv_cache", k, k, a.key_cache, a.value_cache, slots)
            q = meta(t, a.heads, a.head_dim, dtype=a.key_cache.dtype)
            declare_call("paged_decode_attention", q, a.key_cache, a.value_cache, block_tables, seq_lens)
            declare_call("prepared_linear", meta(t, a.q_size), o, list(a.o_w))
            declare_call("rms_norm", x, a.norm_post, a.eps, x)
            declare_call("prepared_linear", x, gate_up, list(a.gate_up_w))
            declare_call("silu_and_mul", meta(t, gate_up_size, dtype=a.gate_up_dtype))
            act = meta(t, gate_up_size // 2, dtype=a.gate_up_dtype)
            declare_call("prepared_linear", act, down, list(a.down_w))
