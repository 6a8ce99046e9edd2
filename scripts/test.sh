#!/usr/bin/env bash
# The test suite. Without CUDA, Triton kernels run in Triton's interpreter (tests/conftest.py sets it)
# and GPU-only tests are skipped with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m pytest -q -n 2 --durations=15 tests "$@"
