#!/usr/bin/env bash
# Create .venv with modelfleet on a machine that has only python3 and pip.
#   bash scripts/setup.sh          # what serving needs
#   bash scripts/setup.sh test     # plus the test tools
# torch 2.13.0 is installed first and pinned. Without an NVIDIA GPU it comes from PyTorch's CPU wheel
# index where that answers (on a plain PyPI the pin resolves to the CUDA build, 15+ nvidia packages),
# else from PyPI; setup says which was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
# the repository root holds a folder named operator/: never let it shadow the standard library
export PYTHONSAFEPATH=1
PY=${PYTHON:-python3}
TORCH="torch==2.13.0"
CPU_INDEX=${MF_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
# pip shows one progress line per download; -q hid ~50 s of work
PIP=(.venv/bin/python -m pip install --progress-bar on --disable-pip-version-check)
step() { echo "setup: $*"; }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv"
  "$PY" -m venv .venv
fi
step "upgrading pip"
"${PIP[@]}" -q --upgrade pip

if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  step "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') is already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  step "an NVIDIA GPU is present: installing $TORCH (CUDA build) from PyPI"
  "${PIP[@]}" "$TORCH"
elif "${PIP[@]}" --timeout 5 --retries 0 --index-url "$CPU_INDEX" "$TORCH" 2>/dev/null; then
  step "installed $TORCH, CPU build, from $CPU_INDEX"
else
  step "$CPU_INDEX did not answer: installing $TORCH from PyPI"
  "${PIP[@]}" "$TORCH"
fi
.venv/bin/python -c "import torch; print('setup: torch', torch.__version__, '(CUDA ' + str(torch.version.cuda) + ')' if torch.version.cuda else '(CPU build)')"

step "installing modelfleet${1:+ with its $1 tools} (editable)"
if [ "${1:-}" = "test" ]; then
  "${PIP[@]}" -e ".[test]"
  # checkov (tests/test_policy.py) pins older packaging and networkx than the project's: a venv of
  # its own beside the project's, as triton sits beside it
  if [ ! -x .venv/checkov/bin/checkov ]; then
    step "installing checkov in .venv/checkov (the chart and examples' policy check)"
    "$PY" -m venv .venv/checkov
    .venv/checkov/bin/python -m pip install -q --disable-pip-version-check "checkov==3.3.30"
  fi
else
  "${PIP[@]}" -e ".[structured]"
fi
# structured output (response_format, tools) is xgrammar's grammar mask; its wheel declares triton
# on Linux x86-64, a GPU kernel library the CPU mask does not use and that the suite must not see
# (scripts/test.sh installs it beside .venv), so xgrammar comes without its declared dependencies
# and the "structured" extra installs those it imports
step "installing xgrammar (structured output) without triton"
"${PIP[@]}" --no-deps "xgrammar==0.2.9"
step "done: .venv/bin/modelfleet --help"
