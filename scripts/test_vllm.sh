#!/usr/bin/env bash
# Runs the tests that need vLLM (pytest marker `vllm`), after creating the isolated venv if needed
# (scripts/setup_vllm.sh; never touches .venv). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VPY=$(scripts/setup_vllm.sh | tail -n 1)
export RESISPEC_VLLM_PYTHON="$PWD/${VPY#./}"
[ -x "$RESISPEC_VLLM_PYTHON" ] || RESISPEC_VLLM_PYTHON="$VPY"
# the project's python (never the vLLM venv's): $PYTHON, else .venv, else the active one
PY=${PYTHON:-python}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD" "$PY" -m pytest -m vllm tests "$@"
