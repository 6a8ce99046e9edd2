#!/usr/bin/env bash
# The GPU check: run on a CUDA machine (the `device` tool's run), in phases so each call stays under the
# tool's 10-minute limit:
#   bash scripts/gpu_check.sh env tests verify          # ~5 min: versions, GPU tests, kiln verify on CUDA
#   bash scripts/gpu_check.sh bench-attention bench-gemm # kernel benchmarks (llm suite), JSON+MD+PNG
#   bash scripts/gpu_check.sh bench-rest                 # norms, rope, activations, softmax, MoE
#   bash scripts/gpu_check.sh engine                     # <10 min: 8B-shaped Llama, random bf16 weights
#       (random:llama3-8b): its GPU load test (no second weight copy), `kiln bench engine` at concurrency
#       1,16,64 (64 tokens, no HF/llama.cpp) -> engine-8b.json/.txt, and `kiln profile --engine --batch 64`
#       (decode tok/s, share of kernel time in Kiln kernels) -> engine-8b-profile.txt
# No phase named = env tests verify. Results go to $OUT (default ./out); commit the JSON/PNG under
# bench/results/ named by date and GPU. Uses the machine's own torch/triton/jax: src on PYTHONPATH, no
# pip install (the GPU image has no network). Packages the image lacks (gguf) can be carried as wheels in
# .wheels/ (carry it): they are installed with --no-index when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET KILN_BACKEND
PY=python3
if [ -d .wheels ]; then $PY -m pip install -q --no-index --no-deps .wheels/*.whl 2>&1 | tail -2; fi
phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(env tests verify)

bench() {  # bench NAME OP...
  local name=$1; shift
  timeout 540 $PY -m kiln.cli bench --suite llm --op "$@" --out "$OUT" --suffix "$name" 2>&1 | tail -60 | tee "$OUT/bench-$name.txt"
}

for phase in "${phases[@]}"; do
  echo "=== phase $phase ($(date -u +%H:%M:%S))"
  case "$phase" in
    env)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.csv"
      $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee "$OUT/versions.txt"
      ;;
    tests)  # every kernel test on the GPU (the `device` fixture is CUDA there), GPU-only tests included
      timeout 420 $PY -m pytest -q -p no:cacheprovider tests/ops tests/verify tests/bench tests/tune tests/jax tests/engine/test_cuda_graphs.py \
        --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
      ;;
    verify)
      timeout 300 $PY -m kiln.cli verify --device cuda --json "$OUT/verify.json" 2>/dev/null | tail -80 | tee "$OUT/verify.txt"
      ;;
    bench-attention) bench attention flash_attention paged_decode_attention paged_prefill_attention write_kv_cache ;;
    bench-gemm) bench gemm linear linear_silu_mul fp8_linear int8_linear int4_linear gguf_linear ;;
    bench-rest) bench rest rms_norm layer_norm softmax rotary_embedding silu_and_mul fused_moe moe_route ;;
    engine)  # issue #6's GPU target: decode at batch 64 on an 8B-shaped Llama with random weights
      timeout 60 $PY -m pytest -q -p no:cacheprovider -m gpu tests/loaders/test_random_weights.py 2>&1 | tail -5 | tee "$OUT/engine-8b-load.txt"
      timeout 310 $PY -m kiln.cli bench engine --model random:llama3-8b --device cuda --concurrency 1,16,64 \
        --max-tokens 64 --num-prompts 64 --hf-batches '' --json "$OUT/engine-8b.json" 2>&1 | tail -30 | tee "$OUT/engine-8b.txt"
      timeout 210 $PY -m kiln.cli profile --engine --model random:llama3-8b --batch 64 --device cuda --top 40 \
        2>&1 | grep -v '^USDT' | tail -80 | tee "$OUT/engine-8b-profile.txt"
      ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
