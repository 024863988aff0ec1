#!/usr/bin/env bash
# The main job on the embedded tiny world: install, build (or reuse) the world, regenerate data with the
# target, distill the draft (forward KL: the measured best, docs/training_losses.md), and report acceptance and speedup.
# Any Hydra override is passed to every stage, e.g. `bash scripts/main.sh +recipe=debug`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
python train/pipeline.py "$@"
