#!/usr/bin/env bash
# Download here, into .gpu_wheels/ (git-ignored), the wheels scripts/gpu_check.sh needs on a GPU machine that has
# torch, transformers, accelerate and peft but no network: Python 3.12, manylinux x86-64, binary wheels only
# (antlr4-python3-runtime, hydra's parser runtime, ships no wheel: it is built here, pure Python).
#
#   bash scripts/gpu_wheels.sh [--python-version 3.12]
#
# Then carry .gpu_wheels/ with the working tree; gpu_check.sh installs from it with `pip install --no-index`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${2:-3.12}"
[ "${1:-}" = "--python-version" ] || PYV=3.12
DEST=.gpu_wheels
mkdir -p "$DEST"
# what the check imports, less what the GPU machine has (torch and the HF stack on top of it). Left out to stay
# small: wandb (imported only when logging is on; the check runs with WANDB_MODE=disabled) and scipy (no
# gpu-marked test uses it)
cat > "$DEST/requirements.txt" <<'REQ'
datasets>=3.0
hydra-core>=1.3.2,<1.4
omegaconf>=2.3
antlr4-python3-runtime==4.9.*
fastapi>=0.110
uvicorn>=0.29
pydantic>=2.5
prometheus-client>=0.20
httpx>=0.27
matplotlib>=3.8
tqdm>=4.66
rich>=13
pytest>=8
pytest-timeout>=2.3
REQ
PIP="${PYTHON:-python} -m pip"
$PIP wheel --no-deps --wheel-dir "$DEST" "antlr4-python3-runtime==4.9.3"
grep -v '^antlr4' "$DEST/requirements.txt" > "$DEST/.binary.txt"
$PIP download --dest "$DEST" --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  --find-links "$DEST" -r "$DEST/.binary.txt" "antlr4-python3-runtime==4.9.3"
rm -f "$DEST/.binary.txt"
# wheels of what torch + transformers + accelerate + peft bring already (pip keeps the installed copies anyway)
HAVE="numpy huggingface_hub hf_xet requests urllib3 certifi idna charset_normalizer packaging filelock fsspec pyyaml
tqdm typing_extensions jinja2 markupsafe safetensors tokenizers regex psutil sympy networkx mpmath"
for name in $HAVE; do rm -f "$DEST/$name"-[0-9]*.whl; done
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
