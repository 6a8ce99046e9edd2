"""kiln.ops.cpu_inductor: a CPU graph compiled for one vector width and cached on disk is not reused
for another (inductor's cache key lacks the width; the options name it)."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from kiln.ops.cpu_inductor import isa_options

# Compiles x * 3 + 1 over 1000 floats through compile_cpu with the inductor cache in argv[1] and prints
# the largest error against eager. (With plain torch.compile the AVX2 run, measured: 1.0e38.)
SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[1]
    import torch
    from kiln.ops.cpu_inductor import compile_cpu

    def f(x):
        return x * 3 + 1

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    out = compile_cpu(f, dynamic=False)(x)
    print((out - f(x)).abs().max().item())
    """
)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector widths")
def test_isa_options_name_the_width_of_atens_capability():
    width = {"AVX512": 512, "AVX2": 256, "DEFAULT": 0}[torch.backends.cpu.get_cpu_capability()]
    assert isa_options() == {"cpp.simdlen": width}


def _run(cache: str, capability: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, cache], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="needs a host whose ATen runs AVX-512, so that a forced AVX2 is another vector width",
)
def test_a_graph_cached_under_avx512_is_compiled_again_under_avx2(tmp_path):
    """The first process caches the graph's 16-lane code; the second, forced to AVX2 with the same
    cache directory, must generate its own 8-lane code, not compile the cached source with AVX2 flags
    (which, measured with torch 2.13, writes garbage into half the outputs or worse)."""
    cache = str(tmp_path / "inductor")
    assert _run(cache, None) < 1e-6
    assert _run(cache, "avx2") < 1e-6
    assert _run(cache, "default") < 1e-6
