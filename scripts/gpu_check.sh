#!/usr/bin/env bash
# The GPU check: what a short visit to an H100/H200 machine (the device tool's `run`) runs, in phases
# that each end well inside the tool's 10-minute cut. docs/gpu_runbook.md gives the calls in order.
#
#   bash scripts/gpu_check.sh [--dry-run | --list] [PHASE ...]      (no PHASE = env verify gputests)
#
# Phases, in the order they matter (correctness first); `--list` prints each step and its limit:
#   env     commit, GPU, CPU and ISA, torch/triton/jax versions, optional packages -> env.json
#   gputests the tests marked gpu (bf16 dots, TMA, compiled Pallas, CUDA-only paths), in parallel
#   tests   the other kernel tests on the GPU in parallel (pytest-xdist when installed), then the
#           timing-sensitive ones alone
#   verify  `kiln verify --device cuda` per backend (triton, triton_tma, pallas_gpu), side by side
#   overhead `kiln profile --engine` of a tiny random model at batch 1 (the engine's per-step overhead)
#   quant   the GEMM benchmarks ("quant" suite): fp8 (per-tensor and block), int8, int4, GGUF planes, bf16
#   bench   the rest of the kernel benchmark suite (llm shapes): attention, norms and the rest
#   engine  8B-shaped Llama with random bf16 weights (random:llama3-8b): `kiln bench engine` at
#           concurrency 1,16,64 and `kiln profile --engine --batch 64`
# KILN_GPU_OPS="op op ...": verify, quant and bench take only these ops (a rerun of what failed or
# changed); the other phases are unaffected.
# Each step runs under `timeout -s INT` (SIGINT: pytest still writes its summary and junit XML,
# `kiln verify` its table and the JSON it rewrites after every row), SIGKILL 10 s later. The limits
# of the phases asked for must add up to at most KILN_CALL_LIMIT_S (540 s), else nothing runs, unless
# KILN_CALL_DEADLINE_S is set: then each step's limit is cut to what is left before that many seconds
# from the start (less 15 s to pack), a step with under 10 s left does not run (exit 124), and a plan
# over the limit runs to the deadline (a short visit's last call: set it to the tool's timeout less ~20 s).
#
# The machine's image has torch/triton/jax/pytest but no network and no gguf: wheels carried in an
# ignored .wheels/ folder are installed with `pip install --no-index --no-deps --target` and put on
# PYTHONPATH with src/ (Kiln itself is not installed). Fetch them here, once (Python 3.12, x86-64):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .wheels gguf==0.19.0
# (gguf's own needs, numpy/pyyaml/requests/tqdm, are in the image; fastapi/uvicorn/openai are not
# needed: the server tests are not run there and skip without them.)
# The commit: KILN_COMMIT, else the .kiln-commit file that scripts/write_kiln_commit.sh writes here
# before the copy (the copy has no .git): carry it.
#
# Results: $OUT (default ./out) gets at most 8 files: <date>-<gpu>-<phases>-logs.tar.gz (every log,
# junit XML and JSON of this call), <date>-<gpu>-<phases>-summary.json (each step's limit, exit
# status, seconds, and the environment), and up to 6 result JSONs named <date>-<gpu>-<what>.json,
# ready for bench/results/. The exit status is 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
CALL_LIMIT_S=${KILN_CALL_LIMIT_S:-540}
DEADLINE_S=${KILN_CALL_DEADLINE_S:-}
KILL_AFTER_S=10
MODE=run
case "${1:-}" in
  --dry-run) MODE=dry; shift ;;
  --list) MODE=list; shift ;;
  -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
esac
ALL_PHASES=(env gputests tests verify overhead quant bench engine)
# docs/gpu_runbook.md: one device call each, in this order; a 15-minute visit runs the first, and the
# second at once while the machine is still warm (a fresh start would cost another minute or more)
RUNBOOK_CALLS=("env verify gputests" "env quant overhead" "env tests" "env bench" "env engine")
phases=("$@")
if [ ${#phases[@]} -eq 0 ] && [ "$MODE" != run ]; then
  phases=("${ALL_PHASES[@]}")  # list or dry-run everything; each runbook call is checked against the limit
  calls=("${RUNBOOK_CALLS[@]}")
else
  [ ${#phases[@]} -gt 0 ] || phases=(env verify gputests)
  [ "${phases[0]}" = env ] || phases=(env "${phases[@]}")  # every call records where it ran
  calls=("${phases[*]}")
fi
for phase in "${phases[@]}"; do
  case "$phase" in env | gputests | tests | verify | overhead | quant | bench | engine) ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done

if [ -n "$DEADLINE_S" ] && ! [[ "$DEADLINE_S" =~ ^[0-9]+$ ]]; then
  echo "KILN_CALL_DEADLINE_S=$DEADLINE_S: expected whole seconds" >&2; exit 2
fi
if [ -n "${KILN_GPU_OPS:-}" ]; then  # a misspelt name would leave verify, quant and bench with nothing
  # shellcheck disable=SC2086
  $PY scripts/gpu_check.py ops --check $KILN_GPU_OPS || exit 2
fi

OUT=${OUT:-$ROOT/out}
CALL=$(IFS=-; echo "${phases[*]}")  # file names there: letters, digits, . _ - only
WORK=${KILN_WORK:-/tmp/kiln-gpu-check}/$CALL-$(date -u +%H%M%S)
DATE=$(date -u +%F)
unset TRITON_INTERPRET KILN_BACKEND
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false  # jax beside torch: no 75% grab
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if [ "$MODE" = dry ]; then export CUDA_VISIBLE_DEVICES="" KILN_REQUIRE_COMMIT=1; fi  # never the GPU

failures=0
phase_cost=0  # seconds the current phase may take: its steps' limits + the SIGKILL grace of each
group_max=-1  # inside a parallel group: the longest step's cost

step() {  # step NAME LIMIT_S CMD...: run CMD under its limit, or (dry) check it, or (list) show it
  local name=$1 limit=$2; shift 2
  local cost=$((limit + KILL_AFTER_S))
  if [ "$group_max" -ge 0 ]; then
    [ "$cost" -gt "$group_max" ] && group_max=$cost
  else
    phase_cost=$((phase_cost + cost))
  fi
  printf '  %-18s %4ss  %s\n' "$name" "$limit" "$*"
  [ "$MODE" = list ] && return 0
  if [ "$MODE" = dry ]; then
    dry_check "$name" "$@" || { echo "  DRY-RUN FAILED: $name" >&2; failures=$((failures + 1)); }
    return 0
  fi
  if [ "$group_max" -ge 0 ]; then
    run_step "$name" "$limit" "$@" >"$WORK/$name.log" 2>&1 &
  else
    run_step "$name" "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
    pack
  fi
}

run_step() {  # the command under timeout; its status and time go to steps.tsv
  local name=$1 limit=$2; shift 2
  local start=$SECONDS rc left
  if [ -n "$DEADLINE_S" ]; then
    left=$((DEADLINE_S - SECONDS - 15))
    if [ "$left" -lt 10 ]; then
      echo "gpu_check: $name not run: ${left}s left before the ${DEADLINE_S}s deadline"
      record_step "$name" 0 124 0
      return 124
    fi
    [ "$left" -lt "$limit" ] && { echo "gpu_check: $name cut to ${left}s (deadline)"; limit=$left; }
  fi
  case "$1" in
    kiln) shift; timeout -s INT -k "$KILL_AFTER_S" "$limit" $PY scripts/gpu_check.py kiln "$@" ;;
    pytest) shift; timeout -s INT -k "$KILL_AFTER_S" "$limit" $PY -m pytest "$@" ;;
    py) shift; timeout -s INT -k "$KILL_AFTER_S" "$limit" $PY "$@" ;;
    *) timeout -s INT -k "$KILL_AFTER_S" "$limit" "$@" ;;
  esac
  rc=$?
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "gpu_check: $name stopped at its ${limit}s limit (exit $rc)"
  record_step "$name" "$limit" "$rc" "$((SECONDS - start))"
  echo "gpu_check: $name exit $rc after $((SECONDS - start))s"
  return $rc
}

record_step() {  # record_step NAME LIMIT RC SECONDS: one row of steps.tsv (gpu_check.py summary reads it)
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$current_phase" "$1" "$2" "$3" "$4" "$1.log" >>"$WORK/steps.tsv"
}

dry_check() {  # what each kind of step can show without CUDA: it parses, imports, collects
  local name=$1; shift
  case "$1" in
    kiln)
      shift
      while [ "$1" != -- ]; do shift; done  # --stamp/--partial: files of the real run
      $PY scripts/gpu_check.py dry "$@" ;;
    pytest)  # collection only, serially: import errors and missing packages show up here
      shift
      local args=() arg rc
      for arg in "$@"; do case "$arg" in --junitxml=*) ;; *) args+=("$arg") ;; esac; done
      [ -n "$(xdist_args)" ] && args+=(-n 0)
      $PY -m pytest --collect-only -q "${args[@]}" >"$WORK/collect-$name.log" 2>&1
      rc=$?
      grep -vE '^tests/' "$WORK/collect-$name.log" | grep -v '^$'
      return $rc ;;
    py) shift; $PY "$@" ;;  # a script that touches no GPU runs as it is
    *) command -v "$1" >/dev/null || [ "$1" = nvidia-smi ] ;;  # the GPU machine has nvidia-smi
  esac
}

parallel() {  # parallel begin | end: the steps between run side by side; the group costs its longest
  if [ "$1" = begin ]; then group_max=0; return; fi
  phase_cost=$((phase_cost + group_max))
  group_max=-1
  if [ "$MODE" = run ]; then
    wait  # each step's exit status is in steps.tsv
    for log in "${group_logs[@]}"; do
      echo "--- $log (last 40 lines; the whole log is in the tarball)"
      tail -n 40 "$WORK/$log"
    done
    pack
  fi
  group_logs=()
}
group_logs=()

xdist_args() {  # pytest-xdist when installed: 12 workers of the 16 cores (Triton compiles on the CPU);
  # test by test, not file by file: one file's cases (flash attention's) outlasted the rest
  if $PY -c "import xdist" 2>/dev/null; then echo "-n 12 --dist load"; fi
}

phase_env() {
  step gpu-name 10 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  step env 30 py scripts/gpu_check.py env "$WORK/env.json"
}

TEST_OPTIONS=(-q -p no:cacheprovider -o junit_family=xunit2 --durations=20)

phase_gputests() {  # the tests marked gpu: no CPU run ever runs them (kernels in bf16, TMA, compiled Pallas)
  # shellcheck disable=SC2046
  step tests-gpu-marked 130 pytest "${TEST_OPTIONS[@]}" -m gpu $(xdist_args) \
    --junitxml="$WORK/tests-gpu-marked.xml" tests/ops tests/jax tests/loaders tests/engine/test_host_upload.py
}

phase_tests() {
  # the native CPU kernels (the "cpu" backends' tests) once, on all cores, before the workers: each
  # worker's first test otherwise waited out the build (H200, 2026-11-29: 63-68 s)
  step native-build 80 py -c "import kiln.ops.native_cpu as n, sys; sys.exit(0 if n.load() else 1)"
  # kernel tests on their own data: safe to spread over workers sharing the GPU
  # shellcheck disable=SC2046
  step tests-kernels 160 pytest "${TEST_OPTIONS[@]}" -m "not gpu" $(xdist_args) --junitxml="$WORK/tests-kernels.xml" \
    tests/ops tests/verify tests/tune tests/jax
  # timings, memory peaks, CUDA graphs and the profiler: alone on the GPU
  step tests-timing 70 pytest "${TEST_OPTIONS[@]}" --junitxml="$WORK/tests-timing.xml" \
    tests/bench tests/profile tests/engine/test_cuda_graphs.py tests/loaders/test_random_weights.py \
    tests/loaders/test_gguf_loader.py
}

# Processes per backend: the Triton and Pallas compiles are most of the time (H200, 2026-11-29: one
# process per backend verified 13 Triton rows and 18 Pallas rows in 170 s, the TMA backend's 6 in 30 s)
declare -A VERIFY_SHARDS=([triton]=6 [pallas_gpu]=3 [triton_tma]=1)

phase_verify() {  # backends' ops split over processes side by side; each rewrites its JSON after every row
  parallel begin
  local backend i n op ops op_args listed
  for backend in triton pallas_gpu triton_tma; do
    n=${VERIFY_SHARDS[$backend]}
    op_args=()
    if [ -n "${KILN_GPU_OPS:-}" ]; then  # only those of the backend's ops, over at most as many processes
      listed=$($PY scripts/gpu_check.py ops "$backend") || { echo "gpu_check: no op list for $backend" >&2; exit 2; }
      # shellcheck disable=SC2086
      read -ra ops <<<"$(only_ops $listed)"
      [ ${#ops[@]} -gt 0 ] || continue
      [ ${#ops[@]} -lt "$n" ] && n=${#ops[@]}
      for op in "${ops[@]}"; do op_args+=(--op "$op"); done
    fi
    for ((i = 1; i <= n; i++)); do
      group_logs+=("verify-$backend-$i.log")
      step "verify-$backend-$i" 200 kiln -- verify --device cuda --backend "$backend" "${op_args[@]}" \
        --shard "$i/$n" --json "$WORK/verify-shards/$backend-${i}of$n.json"
    done
  done
  parallel end
}

only_ops() {  # only_ops OP...: those named in KILN_GPU_OPS (all of them when it is unset or empty)
  if [ -z "${KILN_GPU_OPS:-}" ]; then echo "$*"; return; fi
  local op picked=()
  for op in "$@"; do [[ " $KILN_GPU_OPS " == *" $op "* ]] && picked+=("$op"); done
  echo "${picked[*]}"
}

phase_bench() {  # one after another (timings must not share the GPU); most important ops first
  bench_step bench-attention 100 attention llm \
    flash_attention flash_attention_with_lse paged_decode_attention paged_prefill_attention write_kv_cache
  # Pallas-GPU flash attention against Kiln's Triton kernel, the XLA backend and XLA's own attention
  [ -n "$(only_ops flash_attention)" ] && step bench-attention-jax 50 kiln --partial "$WORK/bench/attention-jax-partial.json" -- \
    bench --suite llm --device cuda --out "$WORK/bench" --suffix attention-jax --op flash_attention \
    --backend pallas_gpu --compare-backends triton,xla
  bench_step bench-rest 90 rest llm rms_norm layer_norm softmax rotary_embedding silu_and_mul fused_moe moe_route
}

bench_step() {  # bench_step NAME LIMIT SUFFIX SUITE OP...: `kiln bench` keeps its cases so far in a partial JSON
  local name=$1 limit=$2 suffix=$3 suite=$4 ops; shift 4
  read -ra ops <<<"$(only_ops "$@")"
  [ ${#ops[@]} -gt 0 ] || return 0  # KILN_GPU_OPS names none of them
  step "$name" "$limit" kiln --partial "$WORK/bench/$suffix-partial.json" -- \
    bench --suite "$suite" --device cuda --out "$WORK/bench" --suffix "$suffix" --op "${ops[@]}"
}

phase_quant() {  # the quantized GEMMs beside bf16 cuBLAS and torch._scaled_mm in one run (#25): the "quant"
  # suite (Llama-3-8B's projections at M = 1, 16, 2048; "llm"'s ~400 cases would not fit the step).
  # GGUF: prepared_linear's cases are the engine's planes, with gguf_linear on the file's blocks and bf16
  # cuBLAS as their baselines (gguf_linear's own quant cases would time the blocks a second time)
  bench_step bench-gemm 130 gemm quant fp8_linear fp8_block_linear int8_linear int4_linear w8a16_linear
  bench_step bench-gguf 130 gguf quant prepared_linear
}

phase_overhead() {  # a tiny model at batch 1: the step is almost all per-step overhead (its phase table, #21)
  step engine-overhead 50 kiln -- profile --engine --model random:tiny --batch 1 --device cuda \
    --timed-steps 50 --top 10
}

phase_engine() {
  step engine-8b 250 kiln --stamp "$WORK/engine-8b.json" -- bench engine --model random:llama3-8b \
    --device cuda --concurrency 1,16,64 --max-tokens 64 --num-prompts 64 --hf-batches '' \
    --json "$WORK/engine-8b.json"
  step engine-8b-profile 130 kiln -- profile --engine --model random:llama3-8b --batch 64 \
    --device cuda --top 40
}

declare -A BUDGET=([env]=60 [gputests]=140 [tests]=350 [verify]=210 [overhead]=60 [quant]=280 [bench]=280 [engine]=400)

pack() {  # every file of this call into $OUT: logs tarball, summary, up to 6 result JSONs
  local prefix="$DATE-$GPU_SLUG"
  $PY scripts/gpu_check.py summary "$WORK" "$WORK/summary.json" || true
  cp "$WORK/summary.json" "$OUT/$prefix-$CALL-summary.json" 2>/dev/null
  tar -czf "$OUT/$prefix-$CALL-logs.tar.gz" -C "$WORK" --exclude=./site --exclude=./out . 2>/dev/null
  local n=0 f base
  for f in "$WORK"/verify-*.json "$WORK"/bench/*.json "$WORK"/engine-*.json; do  # shards merged
    [ -f "$f" ] || continue
    base=$(basename "$f")
    case "$base" in "$DATE"-*) ;; *) base="$prefix-$base" ;; esac
    if [ $n -lt 6 ]; then cp "$f" "$OUT/$base"; n=$((n + 1)); fi
  done
}

# The plan, checked before anything runs: each phase within its budget, each call within the limit
declare -A COST
plan_ok=1
for phase in "${ALL_PHASES[@]}"; do
  phase_cost=0
  saved_mode=$MODE; MODE=list
  "phase_$phase" >/dev/null
  MODE=$saved_mode
  COST[$phase]=$phase_cost
  if [ "$phase_cost" -gt "${BUDGET[$phase]}" ]; then
    echo "phase $phase: its steps take up to ${phase_cost}s, over its budget of ${BUDGET[$phase]}s" >&2
    plan_ok=0
  fi
  if [ "${BUDGET[$phase]}" -gt "$CALL_LIMIT_S" ]; then
    echo "phase $phase: budget ${BUDGET[$phase]}s is over the ${CALL_LIMIT_S}s a call may take" >&2
    plan_ok=0
  fi
done
for call in "${calls[@]}"; do
  total=0
  for phase in $call; do total=$((total + COST[$phase])); done
  echo "=== call \`bash scripts/gpu_check.sh ${call#env }\`: up to ${total}s of the ${CALL_LIMIT_S}s a call may take"
  if [ "$total" -gt "$CALL_LIMIT_S" ]; then
    echo "phases $call take up to ${total}s together, over the ${CALL_LIMIT_S}s a call may take:" \
      "split them over several calls (docs/gpu_runbook.md)" >&2
    plan_ok=0
  fi
done

if [ "$plan_ok" = 0 ] && [ -n "$DEADLINE_S" ]; then
  echo "=== over the plan, but KILN_CALL_DEADLINE_S=${DEADLINE_S}: steps are cut to the deadline"
  plan_ok=1
fi
[ "$plan_ok" = 1 ] || [ "$MODE" = list ] || exit 2  # a list still shows the plan that is refused
if [ "$MODE" = run ]; then
  mkdir -p "$OUT" "$WORK/bench" "$WORK/verify-shards"
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  GPU_SLUG=$(echo "${GPU_NAME:-gpu}" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-|-$//g')
  trap pack EXIT
else  # dry run and list: a scratch folder, and the packing rehearsed into a scratch $OUT
  WORK=$(mktemp -d)
  OUT=$WORK/out GPU_SLUG=dry-run
  mkdir -p "$OUT"
  trap 'rm -rf "$WORK"' EXIT
fi

if [ "$MODE" != list ] && [ -d .wheels ] && compgen -G ".wheels/*.whl" >/dev/null; then
  echo "=== wheels: $(cd .wheels && echo *.whl)"
  if $PY -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .wheels/*.whl \
    >"$WORK/wheels.log" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
  else
    echo "gpu_check: installing .wheels failed (see wheels.log):" >&2; cat "$WORK/wheels.log" >&2
    failures=$((failures + 1))
  fi
fi

echo "=== gpu_check $MODE: ${phases[*]}, results in ${OUT}"
for current_phase in "${phases[@]}"; do
  phase_cost=0
  echo "=== phase $current_phase: budget ${BUDGET[$current_phase]}s, steps up to ${COST[$current_phase]}s" \
    "(each limit + ${KILL_AFTER_S}s SIGKILL grace), $(date -u +%H:%M:%S)"
  "phase_$current_phase"
  if [ "$MODE" = run ]; then
    while IFS=$'\t' read -r _ name _ rc _ _; do
      [ "$rc" = 0 ] || { echo "=== FAILED: $name (exit $rc)"; }
    done < <(grep -P "^$current_phase\t" "$WORK/steps.tsv" 2>/dev/null)
  fi
done

if [ "$MODE" = run ]; then
  pack
  failures=$((failures + $(awk -F'\t' '$4 != 0' "$WORK/steps.tsv" 2>/dev/null | wc -l)))
  echo "=== done: $failures failed step(s); files in $OUT:"; ls -la "$OUT"
elif [ "$MODE" = dry ]; then
  pack  # the packing too: at most 8 files of at most 16 MiB come back from $OUT
  files=$(find "$OUT" -type f | wc -l)
  big=$(find "$OUT" -type f -size +16M | wc -l)
  echo "  pack: $files files in \$OUT ($(cd "$OUT" && echo *))"
  odd=$(find "$OUT" -type f | sed 's|.*/||' | grep -cvE '^[A-Za-z0-9._-]+$')
  if [ "$files" -gt 8 ] || [ "$big" -gt 0 ] || [ "$odd" -gt 0 ]; then
    echo "  DRY-RUN FAILED: pack leaves $files files ($big over 16 MiB, $odd with characters other than" \
      "letters, digits, . _ -); at most 8 such files come back" >&2
    failures=$((failures + 1))
  fi
  echo "=== dry run: $failures problem(s)"
fi
[ "$failures" -eq 0 ] && [ "$plan_ok" = 1 ]
