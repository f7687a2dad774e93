#!/usr/bin/env bash
# Create .venv with modelfleet on a machine that has only python3 and pip.
#   bash scripts/setup.sh          # what serving needs
#   bash scripts/setup.sh test     # plus the test tools
# The CPU build of torch is installed first and pinned: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# the repository root holds a folder named operator/: never let it shadow the standard library
export PYTHONSAFEPATH=1
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "test" ]; then
  .venv/bin/python -m pip install -q -e ".[test]"
  # checkov (tests/test_policy.py) pins older packaging and networkx than the project's: a venv of
  # its own beside the project's, as triton sits beside it
  if [ ! -x .venv/checkov/bin/checkov ]; then
    "$PY" -m venv .venv/checkov
    .venv/checkov/bin/python -m pip install -q "checkov==3.3.30"
  fi
else
  .venv/bin/python -m pip install -q -e .
fi
