"""vLLM as an isolated process (F1: imports nothing of resispec). See process.py."""

from resispec.vllm_venv.process import (
    FIX_DIR,
    FIX_LABEL,
    VllmServer,
    offline_generate,
    parse_spec_metrics,
    server_command,
    spec_config,
    vllm_python,
    vllm_version,
)

__all__ = [
    "FIX_DIR",
    "FIX_LABEL",
    "VllmServer",
    "offline_generate",
    "parse_spec_metrics",
    "server_command",
    "spec_config",
    "vllm_python",
    "vllm_version",
]
