#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), then lint, type-check and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# the repository root holds a folder named operator/: never let it shadow the standard library
export PYTHONSAFEPATH=1
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
