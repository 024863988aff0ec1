#!/usr/bin/env bash
# Installs what the tests need, then runs the default test suite (not slow; gpu tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
python -m pytest "$@"
