#!/usr/bin/env bash
# Write .kiln-commit (git-ignored): the commit this checkout is at, `-dirty` appended when tracked
# files have uncommitted changes. Run it just before the tree is copied to a machine without .git
# (the GPU machine: carry .kiln-commit there); kiln.environment reads it when KILN_COMMIT is unset.
set -euo pipefail
cd "$(dirname "$0")/.."
sha=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then sha="$sha-dirty"; fi
echo "$sha" >.kiln-commit
echo "wrote .kiln-commit: $sha"
