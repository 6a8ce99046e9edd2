"""The native CPU paged decode kernel (cpu_native.cpp): built on first use with PyTorch's C++ extension
builder and the vector ISA flags of ATen's CPU capability on this host, then registered as
torch.ops.kiln_cpu.paged_decode, with a fake implementation so a compiled graph holds it as one node.

`load()` returns True when the op is usable. The build needs a C++ compiler and ninja (the compiled
decode step needs the compiler anyway); when either is missing, or KILN_CPU_NATIVE=0, it returns False
once with a warning and callers keep their pure-PyTorch path. The build is cached by PyTorch under
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), keyed by the source and the flags.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import torch

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_native.cpp")


# ATen's own CPU capability (what its kernels dispatch to on this host) -> the compiler flags and the
# macro that select the same at::vec implementation (inductor's choice for these ISAs too)
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}


def _isa_flags() -> list[str]:
    """Flags for this host's vector ISA as ATen sees it (torch.backends.cpu.get_cpu_capability; it
    honours ATEN_CPU_CAPABILITY); none where ATen runs its default (scalar-width) kernels."""
    return ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])


_state: dict = {"loaded": None, "head_dims": frozenset()}
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load() -> bool:
    """Build (first call on a host; cached on disk after) and register the op, once per process. True
    when it can be called. Call it eagerly (not while torch.compile traces) before relying on ready()."""
    if _state["loaded"] is None:
        _state["loaded"] = _build()
        if _state["loaded"]:
            dims = range(8, 513, 8)
            _state["head_dims"] = frozenset(d for d in dims if torch.ops.kiln_cpu.supports_head_dim(d))
    return _state["loaded"]


def ready(head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether the op is loaded and built for this head dim and cache dtype (no build: plain Python
    that torch.compile evaluates while tracing)."""
    return bool(_state["loaded"]) and head_dim in _state["head_dims"] and cache_dtype in NATIVE_DTYPES


def _build() -> bool:
    if os.environ.get("KILN_CPU_NATIVE", "1") == "0":
        return False
    try:
        from torch.utils import cpp_extension

        # -fopenmp: at::parallel_for is a header template; without it the loop runs on one thread
        flags = ["-O3", "-fopenmp", *_isa_flags()]
        with open(SOURCE, "rb") as f:
            source = f.read()
        # the name carries the flags and the source: another ISA or an edited kernel is another build,
        # so an existing library of this name is current and loads without asking ninja (~1.3 s)
        name = "kiln_cpu_attention_" + hashlib.sha256(" ".join(flags).encode() + source).hexdigest()[:12]
        library = os.path.join(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so")
        if os.path.exists(library):
            torch.ops.load_library(library)
        else:
            cpp_extension.load(
                name=name,
                sources=[SOURCE],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
    except (OSError, RuntimeError, ImportError, ModuleNotFoundError) as error:
        warnings.warn(
            f"kiln: the native CPU paged decode kernel could not be built ({error}); using the PyTorch form",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    _register_fake()
    return True


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::paged_decode")
    def _(q, key_cache, value_cache, block_tables, seq_lens, scale, window):
        return torch.empty_like(q)


def paged_decode(q, key_cache, value_cache, block_tables, seq_lens, scale: float, sliding_window):
    """q [B, H, D] (float32 / bfloat16 / float16); caches [num_blocks, block_size, Hkv, D] (float);
    block_tables [B, W], seq_lens [B] (int32 or int64). Returns [B, H, D] in q's dtype: softmax(scale
    q k^T) v over each sequence's first seq_lens[b] positions (its last sliding_window ones if set).
    Requires load() to have returned True."""
    window = -1 if sliding_window is None else int(sliding_window)
    return torch.ops.kiln_cpu.paged_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, window)
