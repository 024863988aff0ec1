#!/usr/bin/env bash
# lm-eval (EleutherAI's harness) against the server: a bounded, offline loglikelihood task, on localhost only.
#
#   bash scripts/lmeval_server.sh
#
# Starts `serve/server.py +recipe=debug` (the micro pair) on 127.0.0.1 and runs lm-eval's `local-completions`
# model on the multiple-choice task in scripts/lmeval/ (10 Python snippets; every request is a loglikelihood
# request: prompt token ids, `echo: true`, `logprobs: 1`, `max_tokens: 1`). lm-eval lives in its own venv
# (.venv-lmeval, created on first use); it reuses torch/transformers of the project venv through a .pth file rather
# than downloading them again. Extra Hydra overrides for the server: SERVER_ARGS="...".
set -euo pipefail
cd "$(dirname "$0")/.."
PORT="${PORT:-18798}"
VENV=.venv-lmeval
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ ! -x "$VENV/bin/lm_eval" ]; then
    python3 -m venv "$VENV"
    SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$SITE" >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_project.pth"
    # pinned to the project venv's versions: pip never upgrades (nor uninstalls) a package it sees there
    "$PY" -m pip freeze 2>/dev/null | grep "==" >"$VENV/constraints.txt" || true
    "$VENV/bin/pip" install -q -c "$VENV/constraints.txt" "lm-eval[api]==0.4.13"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" # this checkout's resispec, whatever is installed
LOG="$(mktemp -t resispec-lmeval-server.XXXXXX.log)"
OMP_NUM_THREADS=1 "$PY" serve/server.py +recipe=debug server.host=127.0.0.1 "server.port=$PORT" \
    server.model_name=micro server.log_level=warning logger.wandb.mode=disabled \
    "hydra.run.dir=$(dirname "$LOG")/resispec-lmeval-run" ${SERVER_ARGS:-} >"$LOG" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "server exited:"; tail -30 "$LOG"; exit 1; fi
    sleep 1
done
# the tokenizer lm-eval needs to send token ids: the served target's own folder
TOKENIZER="$("$PY" - <<EOF
from hydra import compose, initialize_config_dir

from resispec.config import register_configs, to_typed
from resispec.models import ensure_world

register_configs()
with initialize_config_dir(config_dir="$PWD/conf", version_base=None):
    cfg = to_typed(compose("serve", overrides=["+recipe=debug", *"${SERVER_ARGS:-}".split()]))
print(ensure_world(cfg.world, progress=False).target_dir)
EOF
)"
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 timeout 900 "$VENV/bin/lm_eval" \
    --model local-completions \
    --model_args "model=micro,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$TOKENIZER,tokenized_requests=True,num_concurrent=1,max_retries=1" \
    --include_path scripts/lmeval \
    --tasks resispec_pycode \
    --batch_size 1
