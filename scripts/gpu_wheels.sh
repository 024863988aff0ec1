#!/usr/bin/env bash
# Download here, into .gpu_wheels/ (git-ignored), the wheels scripts/gpu_check.sh needs on a GPU machine that has
# torch, transformers, accelerate and peft but no network: Python 3.12, manylinux x86-64, binary wheels only
# (antlr4-python3-runtime, hydra's parser runtime, ships no wheel: it is built here, pure Python).
#
#   bash scripts/gpu_wheels.sh [--python-version 3.12]
#
# Then carry .gpu_wheels/ with the working tree (the device tool's carry is 64 MiB a call, tree included; this
# folder is ~17 MB): gpu_check.sh installs from it with `pip install --no-index`. The lent GPU machines' image
# already holds pyarrow, matplotlib, pytest, rich, httpx and more (the device library's KINDS.md, read 2026-11-17),
# so their wheels are not carried. Where the image's pyarrow is too old for datasets (the install step's log says
# so), carry .gpu_wheels_big/ (55 MB: pyarrow's wheel) in a call of its own first:
#   pip install --no-index --no-deps .gpu_wheels_big/*.whl    (then the check, carrying .gpu_wheels/)
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
# wheels of what the GPU image has already: torch + transformers + accelerate + peft and what they bring, and the
# image's own packages (KINDS.md's list); pip keeps the installed copies where their versions fit (huggingface_hub
# and hf_xet are carried: datasets 5 needs a newer hub than an older transformers brings)
HAVE="numpy requests urllib3 certifi idna charset_normalizer packaging filelock fsspec pyyaml
tqdm typing_extensions jinja2 markupsafe safetensors tokenizers regex psutil sympy networkx mpmath
matplotlib pillow fonttools kiwisolver contourpy cycler pyparsing python_dateutil six pytest pluggy iniconfig
pytest_timeout rich pygments markdown_it_py mdurl httpx httpcore h11 anyio prometheus_client xxhash
aiohttp aiosignal aiohappyeyeballs attrs frozenlist multidict propcache yarl click annotated_doc tzdata"
for name in $HAVE; do rm -f "$DEST/$name"-[0-9]*.whl; done
# pyarrow (datasets' need, 55 MB) apart, carried only where the image's copy does not fit; pandas (12 MB) stays
mkdir -p "$DEST"_big
mv -f "$DEST"/pyarrow-[0-9]*.whl "$DEST"_big/ 2>/dev/null || true
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST; $(du -sh "$DEST"_big | cut -f1) in ${DEST}_big"
