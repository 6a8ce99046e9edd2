#!/usr/bin/env bash
# One command for a CUDA machine: GPU-marked tests, `kiln verify` on CUDA, and the benchmark suite,
# all written under $OUT (or ./out) as JSON. Uses the machine's own torch/triton: src on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee "$OUT/versions.txt"
python3 -m pytest -q -m gpu tests --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
python3 -m kiln.cli verify --device cuda --json "$OUT/verify.json" 2>/dev/null | tail -60 | tee "$OUT/verify.txt"
if python3 -c "import kiln.bench" 2>/dev/null; then
  python3 -m kiln.cli bench --suite llm --out "$OUT" 2>&1 | tail -80 | tee "$OUT/bench.txt"
fi
