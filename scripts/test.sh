#!/usr/bin/env bash
# Installs what the tests need, then runs the default test suite (not slow; gpu tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
# Two workers (pytest-xdist), each test file on one worker (--dist loadfile: a file's module fixtures built once;
# session fixtures such as the micro world are built once per worker): 6.3 min for the default run on 2 cores against
# 8.6 min in one process. Arguments go to pytest after these (`bash scripts/test.sh -n 0` runs in one process).
python -m pytest -n 2 --dist loadfile "$@"
