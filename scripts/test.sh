#!/usr/bin/env bash
# Set up .venv with the test tools (scripts/setup.sh test), then lint, type-check and run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# the repository root holds a folder named operator/: never let it shadow the standard library
export PYTHONSAFEPATH=1
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
