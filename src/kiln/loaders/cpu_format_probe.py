"""The CPU weight format chosen by measurement on this host, once, then cached.

Which format decodes fastest depends on the CPU: PyTorch's fp16 GEMV beats oneDNN's packed fp32 on
one AVX-512 machine and loses on another; packed bf16 needs AVX512-BF16 / AMX to pay off. So at load
on the CPU, when no format is given, `choose_cpu_formats` times `kiln.ops.prepared_linear` on the
model's own layer-0 projections (fused QKV, o_proj, fused gate/up, down_proj; and separately the LM
head), one-row inputs (single-stream decode, where the formats differ most: several-row inputs run
the same packed fp32 copy under "fp16" and "fp32"), in each candidate format, cache-cold (EVICT_BYTES
written before each pass, as a decode step reads a model larger than the caches from memory), and
keeps the fastest.

Candidates (`KILN_CPU_FORMATS`, comma-separated, overrides them): "fp16", "fp32", "q4_blocks" and
"q8_blocks" (GGUF Q4_0 / Q4_1 / Q4_K matrices as Q4 blocks, Q8_0, Q5_0, Q6_K and Q5_K ones as int8
values and block scales (Q5_K: and mins), whichever of the two is named: a file mixes types,
Q4_K_M's layers Q4_K and Q6_K; other matrices in fp32) and, for a model with GGUF K-quant matrices
on an AVX-512 build, "kquants" (those matrices kept as the file's blocks, 2.3x less memory for a
Q4_K_M file, kiln.ops.gemm.cpu_kquants; kquants_probed()) by default, the formats whose greedy tokens
stay those of the checkpoint (fp16 holds GGUF block values to one rounding, fp32 exactly, q4_blocks,
q8_blocks and kquants exactly: float32 arithmetic on the blocks' own values). "bf16", "int4" (GGUF Q4
weights only) and "int8" round activations to bfloat16 (~3e-2 logit error, flipping near-tied greedy
choices; int8 also requantizes the weights per output channel, which GGUF's 32-weight blocks resolve
more finely), so they are candidates only when asked for: `KILN_CPU_FORMATS=fp16,fp32,bf16,int4,int8`.
"int8_blocks" (GGUF Q8_0 matrices only: float32 on their exact values at one row, a bf16 copy for
several) can be listed too, and "q4_blocks_a8" / "q8_blocks_a8" (the blocks formats with a one-row x
quantized to Q8_0 first, or K-quant weights on their file blocks with every row of x quantized to Q8_K,
llama.cpp's arithmetic: not exact, kiln.ops.gemm.cpu_blocks_a8, cpu_kquants_a8).
"int4_bf16" runs the same kernel as "int4" at one row (it differs at several), so the one-row probe
cannot tell those two apart: list only one of them.

The choice is cached in Kiln's tuning cache (kiln.ops.tuned_configs, `$KILN_TUNE_CACHE`), keyed by the
CPU (`cpu_model_name`: name, family / model / stepping, ISA flags), the vector ISA ATen and Kiln's
native kernels run (`ATEN_CPU_CAPABILITY` can lower it), thread count, torch version, the candidates
and the shapes and block type timed; a later load
reads it without timing anything. `KILN_CPU_FORMAT_PROBE=1` re-times and overwrites it; an explicit
cpu_format skips all of this. An unreadable cache or entry is ignored with a warning (and re-timed).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time
import warnings

import torch

import kiln.ops
from kiln import environment
from kiln.models.weights import GGUFStackedWeight, GGUFWeight, WeightStore, cat_rows
from kiln.ops import tuned_configs
from kiln.ops.gemm import cpu_kquants, cpu_kquants_a8
from kiln.ops.gemm.weight_formats import (
    A8_FORMATS,
    CPU_WEIGHT_FORMATS,
    EXACT_BLOCKS_QTYPES,
    EXACT_FORMATS,
    INT4_QTYPES,
    gguf_source_name,
    kquants_layout_runs,
    prepare_linear_weight,
)

logger = logging.getLogger(__name__)

DEFAULT_CANDIDATES = ("fp16", "fp32", "q4_blocks", "q8_blocks", "kquants")
CACHE_OP = "cpu_weight_format"  # the tuning cache's "op" of these entries
REPEATS = 5  # timed passes per format; the median counts
# written before every pass (untimed), so the weights come from memory as in a decode step of a model
# larger than the caches, not from L2 / L3 where one layer's matrices would sit between passes (a
# format reading more bytes with less arithmetic per byte looks faster warm than it runs); twice a
# 32-64 MB L3
EVICT_BYTES = 128 << 20


@functools.cache
def cpu_model_name() -> str:
    """The CPU as the cache keys it: model name, family / model / stepping and ISA flags
    (kiln.environment.cpu). The name alone is not enough: a virtual machine may report "AMD EPYC"
    for several generations, whose fastest formats differ."""
    info = environment.cpu()
    name = info["cpu_model"] or platform.processor() or "unknown"
    return (
        f"{name} ({info['cpu_id'] or 'unknown id'}; {' '.join(info['cpu_flags']) or 'no listed ISA flags'})"
    )


def candidate_formats(weights: list) -> tuple[str, ...]:
    """The formats to time for `weights` (float tensors, GGUFWeights or GGUFStackedWeights):
    KILN_CPU_FORMATS or DEFAULT_CANDIDATES, without "int4" / "int4_bf16" / "q4_blocks_a8" unless every
    weight is a GGUF Q4 matrix, without "int8_blocks" / "q8_blocks_a8" unless every one is GGUF Q8_0
    (elsewhere they fall back to other layouts), without "gguf". "q4_blocks" (all Q4) or "q8_blocks"
    (all Q8_0) as those; for other GGUF matrices of exact-blocks types (a mixed file's, stacked ones and
    float matrices beside them allowed) the first of the two named; "q4_blocks_a8" / "q8_blocks_a8"
    likewise. "kquants" where some weight is a GGUF K-quant matrix (or a stacked one of them) and it
    runs here (kquants_probed())."""
    names = os.environ.get("KILN_CPU_FORMATS")
    wanted = tuple(n.strip() for n in names.split(",") if n.strip()) if names else DEFAULT_CANDIDATES
    unknown = [n for n in wanted if n not in CPU_WEIGHT_FORMATS]
    if unknown:
        raise ValueError(
            f"KILN_CPU_FORMATS: unknown format(s) {unknown}, expected some of {CPU_WEIGHT_FORMATS}"
        )
    gguf = [w for w in weights if isinstance(w, GGUFWeight)]
    q4 = len(gguf) == len(weights) and all(w.qtype in INT4_QTYPES for w in gguf)
    q8 = len(gguf) == len(weights) and all(w.qtype == "Q8_0" for w in gguf)
    # Other GGUF types with exact blocks (Q5_0, Q6_K, Q5_K, a Q4_K_M file's mix, a fused projection
    # whose parts mix types: GGUFStackedWeight): "q4_blocks" and "q8_blocks" prepare them alike, so
    # only the first of the two named is timed
    gguf += [part for w in weights if isinstance(w, GGUFStackedWeight) for part in w.parts]
    mixed = bool(gguf) and not (q4 or q8) and all(w.qtype in EXACT_BLOCKS_QTYPES for w in gguf)
    first_exact = next((n for n in wanted if n in EXACT_FORMATS), None)
    first_a8 = next((n for n in wanted if n in A8_FORMATS), None)  # the same for their a8 forms
    kquant = any(cpu_kquants_a8.packable(w) for w in weights)

    def keep(name: str) -> bool:
        if name == "kquants":  # elsewhere it prepares every weight as "q4_blocks" does
            return kquant and kquants_probed()
        if name in EXACT_FORMATS:
            return name == first_exact if mixed else (q4 if name == "q4_blocks" else q8)
        if name in A8_FORMATS:
            return name == first_a8 if mixed else (q4 if name == "q4_blocks_a8" else q8)
        if name.startswith(("int4", "q4_blocks")):
            return q4
        if name.startswith(("int8_blocks", "q8_blocks")):
            return q8
        return name != "gguf"

    return tuple(n for n in wanted if keep(n))


def kquants_probed() -> bool:
    """Whether "kquants" is timed for a K-quant model here: where its layout runs
    (weight_formats.kquants_layout_runs) on a build whose row kernel has the tiles (AVX-512:
    cpu_kquants.rows_kernel_max()). On AVX2 builds its 3-4 row calls trail the default's, which a
    one-row probe would not see: 4 Llama-3.2-1B-shaped Q4_K_M layers cache-cold on a 2-core Zen 3,
    its time over the default's, medians of 3 runs: 2 rows 1.01x, 3 rows 1.12x, 4 rows 1.23x, 6-12
    rows 0.96-0.97x (scripts/cpu_kquants_rows.py; the Q6_K down_proj's 2-4 row calls take 1.3x the int8
    blocks layout's)."""
    return kquants_layout_runs() and cpu_kquants.rows_kernel_max() == cpu_kquants.ROWS_KERNEL_MAX_TILES


def time_call(fn, repeats: int = REPEATS, before=None) -> float:
    """Median wall seconds of `fn()` over `repeats` runs after one warm-up; `before()`, when given,
    runs ahead of each (untimed)."""
    times = []
    for i in range(repeats + 1):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        if i:  # the first run warms the code up
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _cache_evictor():
    """A function writing EVICT_BYTES (one buffer, allocated here once for all the passes it serves),
    pushing the timed weights out of the CPU caches."""
    buffer = torch.empty(EVICT_BYTES // 4)
    return lambda: buffer.fill_(1.0)


def _describe(weights: list) -> str:
    parts = []
    for w in weights:
        if isinstance(w, (GGUFWeight, GGUFStackedWeight)):
            kind = gguf_source_name(w)
        else:
            kind = str(w.dtype).removeprefix("torch.")
        parts.append(f"{w.shape[0]}x{w.shape[1]}:{kind}")
    return ",".join(parts)


def _time_format(weights: list, fmt: str, dtype: torch.dtype) -> float:
    """Seconds for one pass of one-row prepared_linear calls over `weights` kept as `fmt`."""
    prepared = [
        prepare_linear_weight(w, device=torch.device("cpu"), dtype=dtype, cpu_format=fmt) for w in weights
    ]
    inputs = [torch.randn(1, p.shape[1], dtype=dtype) for p in prepared]

    def one_pass():
        with torch.inference_mode(), kiln.ops.trusted_inputs():
            for p, x in zip(prepared, inputs, strict=True):
                kiln.ops.prepared_linear(x, p.layout, p.tensors, None, None)

    return time_call(one_pass, before=_cache_evictor())


def choose_format(weights: list, dtype: torch.dtype, role: str) -> str:
    """The fastest candidate format for `weights` (one layer's matrices, or the LM head) on this CPU,
    from the cache when it has this key, else timed and stored. role: "layers" or "lm_head"."""
    candidates = candidate_formats(weights)
    if len(candidates) == 1:
        return candidates[0]
    key_shape = {
        "role": role,
        "cpu": cpu_model_name(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "candidates": ",".join(candidates),
        "weights": _describe(weights),
        "timing": "cache-cold",  # entries timed cache-warm (before this key) are timed again
    }
    cpu = torch.device("cpu")
    if os.environ.get("KILN_CPU_FORMAT_PROBE", "0") in ("", "0"):
        try:
            cached = tuned_configs.lookup(CACHE_OP, dtype, key_shape, device=cpu)
        except ValueError as exc:  # the cache file itself is unreadable
            warnings.warn(f"CPU format probe: ignoring the tuning cache ({exc})", stacklevel=2)
            cached = None
        if cached is not None:
            choice = cached.get("cpu_format")
            if choice in candidates:
                return choice
            warnings.warn(
                f"CPU format probe: ignoring a cached entry with cpu_format {choice!r} (candidates "
                f"{candidates}); timing again",
                stacklevel=2,
            )
    seconds = {fmt: _time_format(weights, fmt, dtype) for fmt in candidates}
    choice = min(seconds, key=seconds.get)
    logger.info(
        "CPU format probe (%s, %s): %s -> %s",
        role,
        key_shape["cpu"],
        ", ".join(f"{f} {1e3 * s:.3f} ms" for f, s in seconds.items()),
        choice,
    )
    meta = {"ms": {f: round(1e3 * s, 4) for f, s in seconds.items()}}
    try:
        tuned_configs.store(CACHE_OP, dtype, key_shape, {"cpu_format": choice}, meta=meta, device=cpu)
    except (ValueError, OSError) as exc:
        warnings.warn(f"CPU format probe: could not cache the choice ({exc})", stacklevel=2)
    return choice


def layer_weights(weights: WeightStore, config, dtype: torch.dtype) -> list:
    """Layer 0's projections as the model fuses them: QKV, o_proj, gate/up, down_proj."""
    c, p = config, "model.layers.0."
    hidden, q_size, kv_size = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    inter = c.intermediate_size
    attn = [weights.get(p + f"self_attn.{n}_proj.weight", (size, hidden)) for n, size in
            (("q", q_size), ("k", kv_size), ("v", kv_size))]  # fmt: skip
    return [
        cat_rows(attn, dtype),
        weights.get(p + "self_attn.o_proj.weight", (hidden, q_size)),
        cat_rows([weights.get(p + f"mlp.{n}_proj.weight", (inter, hidden)) for n in ("gate", "up")], dtype),
        weights.get(p + "mlp.down_proj.weight", (hidden, inter)),
    ]


def lm_head_weight(weights: WeightStore, config):
    """The LM head's matrix (the embedding when tied)."""
    name = "lm_head.weight"
    if config.tie_word_embeddings and name not in weights:
        name = "model.embed_tokens.weight"
    return weights.get(name, (config.vocab_size, config.hidden_size))


def choose_cpu_formats(
    weights: WeightStore, config, dtype: torch.dtype, *, layers: bool = True, lm_head: bool = True
) -> tuple[str | None, str | None]:
    """(cpu_format, lm_head_format) picked by measurement (see the module docstring); None for a part
    not asked for (`layers` / `lm_head` False) or whose weights cannot be read as one matrix each."""
    chosen_layers = chosen_head = None
    with torch.inference_mode(False), torch.no_grad():
        if layers:
            chosen_layers = choose_format(layer_weights(weights, config, dtype), dtype, "layers")
        if lm_head:
            chosen_head = choose_format([lm_head_weight(weights, config)], dtype, "lm_head")
    return chosen_layers, chosen_head
