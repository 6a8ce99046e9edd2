"""Compile Kiln's native CPU sources (kiln.ops.native_cpu.SOURCES) for every vector ISA the library is
built for (native_cpu.ISA_FLAGS, AVX-512 with VNNI as hosts that have it add it, and the default
scalar-width build), syntax only, whatever this host
runs. A host builds only its own ISA, so an AVX-512 mistake in a kernel written on an AVX2 machine (or
the reverse) would otherwise first show on another host, as a failed build there and every native op
falling back to its PyTorch form. ~1.5 minutes an ISA on 2 cores; run it after editing a .cpp:

    python scripts/check_native_isas.py [--isa AVX512]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from torch.utils import cpp_extension

from kiln.ops import native_cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--isa", action="append", help="only these (AVX512, AVX512_VNNI, AVX2, default); repeatable"
    )
    args = parser.parse_args()
    avx512 = native_cpu.ISA_FLAGS["AVX512"]
    flag_sets = {**native_cpu.ISA_FLAGS, "AVX512_VNNI": [*avx512, "-mavx512vnni"], "default": []}
    failed = []
    for isa in args.isa or list(flag_sets):
        command = [
            "g++", "-std=c++20", "-fopenmp", "-fsyntax-only", "-w",
            *(f"-I{path}" for path in (*cpp_extension.include_paths(), *native_cpu.INCLUDE_DIRS)),
            *flag_sets[isa], *native_cpu.SOURCES,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        print(f"{isa}: {'ok' if done.returncode == 0 else 'FAILED'}", flush=True)
        if done.returncode != 0:
            failed.append(isa)
            print(done.stderr[-4000:], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
