"""Kiln's native CPU kernels: the C++ sources below, built into one library on first use with PyTorch's
C++ extension builder and the vector ISA flags of ATen's CPU capability on this host, registering
their ops under torch.ops.kiln_cpu:

    paged_decode_attention/cpu_native.cpp   kiln_cpu.paged_decode, kiln_cpu.paged_decode_fp8,
                                            kiln_cpu.supports_head_dim
    attention/cpu_causal_attention.cpp      kiln_cpu.causal_attention (one sequence's prefill attention,
                                            float32), kiln_cpu.causal_attention_head_dim
    gemm/cpu_w8a8.cpp                       kiln_cpu.w8a8_linear (on oneDNN)
    gemm/cpu_w8a8_amx.cpp                   kiln_cpu.w8a8_amx_linear, kiln_cpu.amx_int8_available
    gemm/cpu_q4_blocks.cpp                  kiln_cpu.q4_blocks_gemv (GGUF Q4_0 / Q4_1 blocks, one row)
    gemm/cpu_q8_blocks.cpp                  kiln_cpu.q8_blocks_gemv (GGUF Q8_0 blocks, one row; Q5_K's
                                            given their mins), kiln_cpu.q8_blocks_gemm (a few rows)
    gemm/cpu_blocks_a8.cpp                  kiln_cpu.q4_blocks_a8_gemv, q8_blocks_a8_gemv (the same
                                            blocks, x quantized to Q8_0 first), kiln_cpu.quantize_q8_0
    gemm/cpu_kquants_a8.cpp                 kiln_cpu.kquants_a8_gemv / kquants_a8_gemm (GGUF Q4_K / Q5_K /
                                            Q6_K blocks as in the file, x quantized to Q8_K; one row / any
                                            rows, each as alone), kiln_cpu.quantize_q8_k
    gemm/cpu_kquants_a8_amx.cpp             kquants_a8_gemm's 16-row blocks of weights on AMX tiles (CPUs
                                            with AMX-INT8, from 12 rows of x; KILN_CPU_AMX=0: not)
    gemm/cpu_kquants.cpp                    kiln_cpu.kquants_gemm (the same blocks, exact float32: x
                                            not rounded; the few-row kernel)
    gemm/cpu_gguf_rows.cpp                  kiln_cpu.gguf_rows (rows of a GGUF table decoded on lookup:
                                            the embeddings)
    gemm/cpu_block_tiles.cpp                kiln_cpu.q4_tiles_gemm (Q4 blocks in 16-row tiles, batched
                                            decode)
    gemm/cpu_q8_tiles.cpp                   kiln_cpu.q8_tiles_gemm (the same for Q8_0)
    gemm/cpu_blocks_panel.cpp               kiln_cpu.blocks_panel_gemm, kquants_panel_gemm (the exact
                                            blocks' many-row kernel)
    norm/rms_norm/rms_norm_cpu.cpp          kiln_cpu.rms_norm (float32)
    rope/rotary_embedding/rotary_embedding_cpu.cpp  kiln_cpu.rotary_embedding_ (float32, in place)
    activation/silu_and_mul/silu_and_mul_cpu.cpp    kiln_cpu.silu_and_mul (float32)
    activation/gelu_tanh_and_mul/gelu_tanh_and_mul_cpu.cpp  kiln_cpu.gelu_tanh_and_mul (float32)
    attention/write_kv_cache/write_kv_cache_cpu.cpp kiln_cpu.write_kv_cache (float32 caches)
    ../models/cpu_flat_decode.cpp           torch.classes.kiln_cpu.FlatDecode (a model's one-token
                                            decode through the layers above in one call)

The last five serve the eager CPU path of their ops (each op's cpu.py) for float32 tensors, one call
each instead of several ATen calls; a compiled decode step traces those ops' tensor forms instead.
native_cpu_ops.h declares the ops' C++ entry points, so that FlatDecode calls them directly.

An engine on the CPU calls `load()` when it starts (kiln.engine.model_runner), so a host's first
build (~1 minute on 2 cores, announced by a warning) is part of loading, not of the first step's time.
`load()` returns True when the ops are usable. The build needs a C++ compiler and ninja (the compiled
decode step needs the compiler anyway); when either is missing, or KILN_CPU_NATIVE=0, it returns False
once with a warning and each op's callers keep their PyTorch path. The build is cached by PyTorch
under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), named by the sources and the flags.
Each op's Python module (the `cpu_native` / `cpu_w8a8` / `cpu_q4_blocks` / `cpu_q8_blocks` beside its
source) registers its fake implementation after a successful load, so a compiled graph holds the op as
one node.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings

import torch

from kiln import environment

_OPS = os.path.dirname(__file__)
SOURCES = (
    # (the builder names object files after their sources: no two may share a file name)
    os.path.join(_OPS, "attention", "paged_decode_attention", "cpu_native.cpp"),
    os.path.join(_OPS, "attention", "cpu_causal_attention.cpp"),
    os.path.join(_OPS, "gemm", "cpu_w8a8.cpp"),
    os.path.join(_OPS, "gemm", "cpu_w8a8_amx.cpp"),
    os.path.join(_OPS, "gemm", "cpu_q4_blocks.cpp"),
    os.path.join(_OPS, "gemm", "cpu_q8_blocks.cpp"),
    os.path.join(_OPS, "gemm", "cpu_blocks_a8.cpp"),
    os.path.join(_OPS, "gemm", "cpu_kquants_a8.cpp"),
    os.path.join(_OPS, "gemm", "cpu_kquants_a8_amx.cpp"),
    os.path.join(_OPS, "gemm", "cpu_kquants.cpp"),
    os.path.join(_OPS, "gemm", "cpu_gguf_rows.cpp"),
    os.path.join(_OPS, "gemm", "cpu_block_tiles.cpp"),
    os.path.join(_OPS, "gemm", "cpu_q8_tiles.cpp"),
    os.path.join(_OPS, "gemm", "cpu_blocks_panel.cpp"),
    os.path.join(_OPS, "norm", "rms_norm", "rms_norm_cpu.cpp"),
    os.path.join(_OPS, "rope", "rotary_embedding", "rotary_embedding_cpu.cpp"),
    os.path.join(_OPS, "activation", "silu_and_mul", "silu_and_mul_cpu.cpp"),
    os.path.join(_OPS, "activation", "gelu_tanh_and_mul", "gelu_tanh_and_mul_cpu.cpp"),
    os.path.join(_OPS, "attention", "write_kv_cache", "write_kv_cache_cpu.cpp"),
    os.path.join(os.path.dirname(_OPS), "models", "cpu_flat_decode.cpp"),
)
# hashed into the build's name too
HEADERS = (
    os.path.join(_OPS, "gemm", "cpu_w8a8_quantize.h"),
    os.path.join(_OPS, "gemm", "cpu_float_lanes.h"),
    os.path.join(_OPS, "gemm", "cpu_q8_activations.h"),
    os.path.join(_OPS, "gemm", "cpu_gguf_fields.h"),
    os.path.join(_OPS, "gemm", "cpu_kquants_decode.h"),
    os.path.join(_OPS, "gemm", "cpu_k4_tiles.h"),
    os.path.join(_OPS, "gemm", "cpu_q6_k_tiles.h"),
    os.path.join(_OPS, "gemm", "cpu_tile_lanes.h"),
    os.path.join(_OPS, "gemm", "cpu_amx.h"),
    os.path.join(_OPS, "gemm", "cpu_kquants_a8.h"),
    os.path.join(_OPS, "activation", "cpu_gated_rows.h"),
    os.path.join(_OPS, "native_cpu_ops.h"),
)
INCLUDE_DIRS = (_OPS,)  # where the sources find native_cpu_ops.h

# ATen's own CPU capability (what its kernels dispatch to on this host) -> the compiler flags and the
# macro that select the same at::vec implementation (inductor's choice for these ISAs too)
ISA_FLAGS = {
    # -mf16c: every AVX-512 CPU has F16C, but -mavx512f does not enable it (_mm_cvtph_ps)
    "AVX512": [
        "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512"
    ],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}

# Up to this many rows of x, the GGUF-block layouts' multi-row kernels (q4_blocks_gemm, q8_blocks_gemm)
# beat oneDNN's float32 GEMM on their float32 copies (2 cores, cache-cold, SmolLM2's shapes,
# scripts/cpu_blocks_rows.py). Zen 3, AVX2: Q4 layers 3.2x at 2 rows, 2.2x at 8, 1.5x at 16, 1.17x at
# 32, 0.98x at 48; the Q8_0 head 2.4x at 2, 1.2x at 16, 0.99x at 32, 0.79x at 48. Zen 5, AVX-512:
# layers 3.0x at 2, 1.9x at 8, 1.35x at 16, 1.04x at 32, 0.96x at 48; head 2.5x at 2, 1.16x at 16,
# 0.91x at 32. The AVX2 and AVX-512 builds have them; elsewhere each row would run the one-row kernel.
BLOCKS_GEMM_MAX_ROWS = 32
# AVX-512 builds: BLOCKS_TILES_ROWS[kind] (first, last) rows of x run the Q4 / Q8_0 layouts' 16-row tile
# kernels (q4_tiles_gemm, q8_tiles_gemm; kiln.ops.gemm.cpu_block_tiles), which beat both the row kernels
# above and oneDNN there. Zen 5, the same measurement: Q4 layers 1.07-1.11x the row kernel at 16 rows
# and 1.19-1.22x at 32, 1.08-1.12x oneDNN at 64 (which wins from ~128 rows; below 8 rows the row kernel
# wins); the Q8_0 head 1.08-1.13x the row kernel at 16 rows, 1.19-1.25x at 24-32, even at 12 and
# slower at 8 (0.8-0.9x), oneDNN even with it from 48 rows. (An earlier Q8_0 tile kernel, session 21's,
# was 0.76x the row kernel at 8 rows and even at 16: this one takes one tile by up to 16 rows a pass.)
# On AVX2 (8-lane) builds the Q4 tile kernel was slower than the row kernel (0.8-0.9x at 8-32 rows), and
# the Q8_0 one is unmeasured there: neither runs on them.
BLOCKS_TILES_ROWS = {"q4": (8, 64), "q8": (16, 32)}
# Where the panel kernel runs (blocks_panel_runs(): kiln_cpu::blocks_panel_gemm past the tiles), it takes
# the Q4 rows past 32: 2-core Zen 4, the kernels alone, tiles / panel even at 32 rows, the panel 1.05-1.2x
# faster at 64 (SmolLM2's and Llama-3.2-1B's shapes); SmolLM2's engine at 48 / 64 sequences (`kiln bench
# engine --concurrency 48,64 --max-tokens 64`, two alternating pairs): 389 / 400 -> 408 / 409 and
# 358 / 404 -> 415 / 422 tok/s.
BLOCKS_TILES_ROWS_WITH_PANEL = {"q4": (8, 32), "q8": (16, 32)}

_state: dict = {"loaded": None, "gemm_rows": None, "tiles_rows": None, "panel": None}
logger = logging.getLogger(__name__)


def _isa_flags() -> list[str]:
    """Flags for this host's vector ISA as ATen sees it (torch.backends.cpu.get_cpu_capability; it
    honours ATEN_CPU_CAPABILITY); none where ATen runs its default (scalar-width) kernels. AVX-512
    builds add VNNI where the host has it (/proc/cpuinfo's avx512_vnni) unless KILN_CPU_VNNI=0: the
    K-quant kernels then fuse each int16 product pair's sum into their int32 accumulators
    (vpdpwssd; 2-core Zen 4, prefill- and batch-sized x: 10-20 % faster, the same integers)."""
    flags = list(ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), []))
    vnni = os.environ.get("KILN_CPU_VNNI", "1") != "0" and "avx512_vnni" in environment.cpu()["cpu_flags"]
    return flags + ["-mavx512vnni"] if "-DCPU_CAPABILITY_AVX512" in flags and vnni else flags


def blocks_gemm_rows() -> int:
    """The most rows of x prepared_linear gives the blocks layouts' row kernels (q4_blocks_gemm,
    q8_blocks_gemm; more go to the Q4 tiles or the float32 copy): BLOCKS_GEMM_MAX_ROWS where the library
    is loaded and built for AVX2 or AVX-512, else 1. A constant once `load` ran, so torch.compile traces
    it as one (before that, while tracing: 1)."""
    if _state["gemm_rows"] is None and not torch.compiler.is_compiling():
        load()
    return _state["gemm_rows"] or 1


def blocks_tiles_rows(kind: str) -> tuple[int, int]:
    """(first, last): the rows of x prepared_linear gives the "q4" (Q4 blocks) or "q8" (Q8_0) layouts'
    tile kernel (q4_tiles_gemm / q8_tiles_gemm): BLOCKS_TILES_ROWS[kind] (BLOCKS_TILES_ROWS_WITH_PANEL's
    where blocks_panel_runs()) where the library is loaded and built for AVX-512, else (0, 0) (no tile
    kernel: the layouts keep no tiles). A constant once `load` ran, as blocks_gemm_rows()."""
    if kind not in BLOCKS_TILES_ROWS:
        raise ValueError(f"blocks_tiles_rows: kind {kind!r}, expected one of {', '.join(BLOCKS_TILES_ROWS)}")
    if _state["tiles_rows"] is None and not torch.compiler.is_compiling():
        load()
    return (_state["tiles_rows"] or {}).get(kind, (0, 0))


def blocks_tiles_take(kind: str, rows: int) -> bool:
    """Whether `rows` rows of x go to the "q4" / "q8" layouts' tile kernel on this build (within
    blocks_tiles_rows(kind); never where that is (0, 0))."""
    first, last = blocks_tiles_rows(kind)
    return 0 < first <= rows <= last


def blocks_panel_runs() -> bool:
    """Whether the exact blocks layouts run their many-row calls (prefill, large batches) on the blocks
    themselves here (kiln_cpu::blocks_panel_gemm, kiln.ops.gemm.cpu_blocks_panel: the library is loaded
    and built for AVX2 or AVX-512), so they keep no float32 copy. KILN_CPU_BLOCKS_PANEL=0: keep the copy
    for oneDNN's float32 GEMM instead (4 bytes a weight more; prefill 0-20 % faster, kiln.ops.gemm.
    cpu_blocks_panel). A constant once `load` ran, as blocks_gemm_rows()."""
    if _state["panel"] is None and not torch.compiler.is_compiling():
        load()
    return bool(_state["panel"])


def load() -> bool:
    """Build (first call on a host; cached on disk after) and load the library, once per process.
    True when its ops can be called. Call it eagerly, not while torch.compile traces."""
    if _state["loaded"] is None:
        _state["loaded"] = _build()
        flags = _isa_flags()  # the build's vector ISA (AVX2 or AVX-512), none for a scalar build
        vector = _state["loaded"] and bool(flags)
        _state["gemm_rows"] = BLOCKS_GEMM_MAX_ROWS if vector else 1
        _state["panel"] = vector and os.environ.get("KILN_CPU_BLOCKS_PANEL", "1") != "0"
        tiles = BLOCKS_TILES_ROWS_WITH_PANEL if _state["panel"] else BLOCKS_TILES_ROWS
        _state["tiles_rows"] = tiles if vector and "-DCPU_CAPABILITY_AVX512" in flags else {}
    return _state["loaded"]


def load_op(state: dict, register_fake) -> bool:
    """An op module's `load()`: `load` the library once into state["loaded"] and, when that succeeds,
    call register_fake() (the op's fake implementation, so a compiled graph holds it as one node)."""
    if state["loaded"] is None:
        state["loaded"] = load()
        if state["loaded"]:
            register_fake()
    return state["loaded"]


def _build() -> bool:
    if os.environ.get("KILN_CPU_NATIVE", "1") == "0":
        return False
    try:
        from torch.utils import cpp_extension

        # -fopenmp: at::parallel_for is a header template; without it the loops run on one thread
        flags = ["-O3", "-fopenmp", *_isa_flags()]
        # the torch version too: a library built against another torch's headers must not be loaded
        digest = hashlib.sha256(" ".join([torch.__version__, *flags]).encode())
        for source in (*SOURCES, *HEADERS):
            with open(source, "rb") as f:
                digest.update(f.read())
        # the name carries torch, the flags and the sources: another ISA or an edited kernel is another build,
        # so an existing library of this name is current and loads without asking ninja (~1.3 s)
        name = "kiln_cpu_" + digest.hexdigest()[:12]
        library = os.path.join(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so")
        if os.path.exists(library):
            torch.ops.load_library(library)
        else:  # a warning, not info: a minute of silence on a host's first run would look like a hang
            logger.warning(
                "kiln: building the native CPU kernels for this host (once; cached as %s)", library
            )
            start = time.perf_counter()
            cpp_extension.load(
                name=name,
                sources=list(SOURCES),
                extra_cflags=flags,
                extra_include_paths=list(INCLUDE_DIRS),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
            logger.warning("kiln: native CPU kernels built in %.0f s", time.perf_counter() - start)
    except (OSError, RuntimeError, ImportError, ModuleNotFoundError) as error:
        warnings.warn(
            f"kiln: the native CPU kernels could not be built ({error}); using their PyTorch forms",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True
