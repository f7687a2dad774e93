#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), then run the bundled demo model as a local fleet of two
# pipeline stages on the CPU behind an OpenAI-compatible gateway on port 8000. Ctrl-C stops it.
# Extra arguments go to `modelfleet up` (see `.venv/bin/modelfleet up --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
# the repository root holds a folder named operator/: never let it shadow the standard library
export PYTHONSAFEPATH=1
bash scripts/setup.sh
exec .venv/bin/modelfleet up --stages 2 --device cpu "$@"
