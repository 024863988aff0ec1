#!/usr/bin/env bash
# The prepared GPU check (issue 41): on a machine with one NVIDIA GPU, no network, torch / transformers / accelerate
# / peft installed, and the wheel folder from scripts/gpu_wheels.sh (.gpu_wheels/), within 8 minutes:
#
#   bash scripts/gpu_check.sh             # -> $OUT (or outputs/gpu_check/): gpu_check.json, gpu_check.md, logs
#   bash scripts/gpu_check.sh --dry-run   # the same parts on the CPU at micro / stand-in sizes (CI runs this)
#
# Budgets (seconds, each part under its own timeout so one overrun loses only itself): install 45, tests 75,
# world 150 (tiny world build + AR vs every rule on a chain and tree=auto + forward cost 1-64 tokens),
# distill 110 (8B-shaped target, 1B-shaped draft, bf16, 4 steps), serve 80 (8 concurrent clients), report 20:
# 480 s in all. A dry run gives every part 120 s.
set -u
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT_DIR="${OUT:-outputs/gpu_check}"
[ $DRY = 1 ] && OUT_DIR="${GPU_CHECK_OUT:-outputs/gpu_check_dry}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
: > "$OUT_DIR/status.tsv"
PY="${PYTHON:-python}"
budget() {  # part -> seconds
  if [ $DRY = 1 ]; then echo 120; return; fi
  case "$1" in install) echo 45;; tests) echo 75;; world) echo 150;; distill) echo 110;; serve) echo 80;; *) echo 20;; esac
}
step() {  # name, command...: run under the part's timeout, record rc and seconds
  local name=$1; shift
  local b; b=$(budget "$name")
  local t0; t0=$(date +%s.%N)
  timeout --kill-after=5 "$b" "$@"
  local rc=$?
  local t1; t1=$(date +%s.%N)
  printf '%s\t%s\t%.1f\t%s\n' "$name" "$rc" "$(echo "$t1 - $t0" | bc)" "$b" >> "$OUT_DIR/status.tsv"
  echo "[gpu_check] $name: rc $rc"
}
if [ $DRY = 0 ] && [ -d .gpu_wheels ]; then
  # offline: only the wheels downloaded beforehand; what is installed already (torch, transformers, ...) stays
  BIG=(); [ -d .gpu_wheels_big ] && BIG=(--find-links .gpu_wheels_big)  # only where carried (gpu_wheels.sh)
  step install "$PY" -m pip install --no-index --find-links .gpu_wheels "${BIG[@]}" -r .gpu_wheels/requirements.txt \
    > "$OUT_DIR/install.log" 2>&1
  step install_project "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . >> "$OUT_DIR/install.log" 2>&1
fi
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
FLAGS=()
[ $DRY = 1 ] && FLAGS=(--dry-run)
for part in tests world distill serve; do
  if [ $DRY = 1 ]; then  # the CPU dry run: the parts side by side (they are mostly start-up); on the GPU in turn
    step "$part" "$PY" scripts/gpu_check.py "$part" --out "$OUT_DIR" "${FLAGS[@]}" > "$OUT_DIR/$part.out" 2>&1 &
  else
    step "$part" "$PY" scripts/gpu_check.py "$part" --out "$OUT_DIR" "${FLAGS[@]}" > "$OUT_DIR/$part.out" 2>&1
  fi
done
wait
step report "$PY" scripts/gpu_check.py report --out "$OUT_DIR" "${FLAGS[@]}"
echo "[gpu_check] report: $OUT_DIR/gpu_check.md, $OUT_DIR/gpu_check.json"
# exit status: the report's (0 when every part passed)
tail -n 1 "$OUT_DIR/status.tsv" | cut -f2 | { read -r rc; exit "$rc"; }
