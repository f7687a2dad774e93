#!/usr/bin/env bash
# Set up .venv, build a tiny random Qwen3-MoE checkpoint offline (until the bundled demo model
# lands), and generate from it with the engine cut into two shards.
set -euo pipefail
cd "$(dirname "$0")/.."
# the repository root holds a folder named operator/: never let it shadow the standard library
export PYTHONSAFEPATH=1
bash scripts/setup.sh
DEMO=${MF_DEMO_DIR:-out/tiny-qwen3-moe}
if [ ! -f "$DEMO/config.json" ]; then
  .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); from tiny import save_model; save_model('qwen3_moe', '$DEMO')"
fi
.venv/bin/modelfleet generate --model "$DEMO" --prompt-ids 5,17,99,3 --max-tokens 16 --shards 2 --json
