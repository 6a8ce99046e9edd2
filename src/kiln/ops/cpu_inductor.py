"""Inductor options that tie a CPU compile's cached code to the vector ISA it was generated for.

Inductor writes its C++ kernels for one vector width (16 floats a vector with AVX-512, 8 with AVX2,
scalar code for ATen's "default" capability) and caches the generated source on disk (its FX graph
cache, /tmp/torchinductor_<user> unless TORCHINDUCTOR_CACHE_DIR says otherwise). The cache key holds
torch's version and inductor's config but not the width: a graph cached under AVX-512 and loaded under
`ATEN_CPU_CAPABILITY=avx2` (or on another host sharing the cache directory) is compiled with AVX2 flags
from 16-lane source, whose 16-float loads overrun 8-float vectors: garbage and NaN, no error (torch
2.13; Kiln's compiled decode step gave NaN logits that way). Naming the width in `cpp.simdlen`, which
the key does hold, gives each width its own entries; it picks the ISA inductor would pick anyway."""

from __future__ import annotations

import functools

import torch


@functools.cache
def isa_options() -> dict:
    """{"cpp.simdlen": bits} for the vector ISA inductor generates CPU code for in this process (512,
    256, or 0 for none, following ATEN_CPU_CAPABILITY as inductor does): add it to the options of every
    CPU torch.compile whose code may come from the on-disk cache. Probes the compiler once (inductor's
    own ISA check), so call it when compiling, not at import."""
    from torch._inductor import cpu_vec_isa

    return {"cpp.simdlen": cpu_vec_isa.pick_vec_isa().bit_width()}


def compile_cpu(fn, **kwargs):
    """torch.compile(fn, **kwargs) with isa_options() merged into its inductor options."""
    options = {**kwargs.pop("options", {}), **isa_options()}
    return torch.compile(fn, options=options, **kwargs)
