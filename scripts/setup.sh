#!/usr/bin/env bash
# Creates .venv (once) and installs ResiSpec into it with the dev extras.
# torch goes in first, as a CPU build unless this machine has an NVIDIA GPU, so a CPU machine never
# pulls a multi-GB CUDA wheel. Source this file: it activates the venv for the caller.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
VENV=${RESISPEC_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install "torch>=2.4,<3"
  # A local CPU wheel (pip's find-links), else the CPU index of pytorch.org.
  elif ! python -m pip install --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
    python -m pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
python -m pip install -q -e ".[dev]"
