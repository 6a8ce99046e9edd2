#!/usr/bin/env bash
# The test suite. Without CUDA, Triton kernels run in Triton's interpreter (tests/conftest.py sets it)
# and GPU-only tests are skipped with a reason. Two xdist workers share the 2 cores, so each gets one
# intra-op thread: oversubscribed OpenMP threads spin against each other and run many times slower.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"${PYTHON:-python3}" -m ruff check src tests scripts
# The API reference builds in strict mode: a broken reference or a stale page fails the run.
"${PYTHON:-python3}" -m mkdocs build --strict --quiet --site-dir build/site
exec "${PYTHON:-python3}" -m pytest -q -n 2 --durations=25 tests "$@"
