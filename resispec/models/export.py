"""Export a tuned draft for an existing engine: a plain HF checkpoint (LoRA merged) + tokenizer that vLLM loads as a
`draft_model` and SGLang as a standalone draft, with the serve commands written beside it.

Compatibility is checked BEFORE any weights load, from configs and tokenizers only, and each failure is one line
(`ExportError`): vocabulary size and tokens, special tokens, context length, head_dim supported by the backend.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

from resispec.models.export_base import (
    HEAD_DIMS,
    TMP_PREFIX,
    ExportError,
    ExportResult,
    default_backend,
    head_dim,
)
from resispec.models.head import is_head_dir
from resispec.models.head_export import export_head
from resispec.models.loading import (
    TokenizerMismatchError,
    check_same_tokenizer,
    load_tokenizer,
    resolve_model_path,
)

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def context_length(config) -> int | None:
    return getattr(config, "max_position_embeddings", None)


def _config_ids(config, name: str):
    value = getattr(config, name, None)
    return sorted(value) if isinstance(value, list) else value


def check_compatible(
    draft_config,
    draft_tok,
    target_config,
    target_tok,
    backend: str,
    max_model_len: int | None = None,
    tp: int = 1,
) -> dict:
    """Raise ExportError (one line) unless the draft fits the target on `backend`; returns what was checked.

    max_model_len: the context the server will run with (default: the target's); the draft must reach it."""
    if backend not in HEAD_DIMS:
        raise ExportError(f"unknown backend {backend!r}; use one of {sorted(HEAD_DIMS)}")
    if draft_config.vocab_size != target_config.vocab_size:
        raise ExportError(
            f"vocabulary size differs: draft {draft_config.vocab_size}, target {target_config.vocab_size} "
            "(the engines verify draft token ids against the target's logits row by row)"
        )
    try:
        check_same_tokenizer(target_tok, draft_tok)
    except TokenizerMismatchError as err:
        raise ExportError(str(err).splitlines()[0]) from None
    for name in SPECIAL_TOKENS:
        a, b = getattr(draft_tok, name, None), getattr(target_tok, name, None)
        if a != b:
            raise ExportError(f"special token {name} differs: draft tokenizer {a}, target tokenizer {b}")
    for name in ("bos_token_id", "eos_token_id"):
        a, b = _config_ids(draft_config, name), _config_ids(target_config, name)
        if a is not None and b is not None and a != b:
            raise ExportError(f"special token {name} differs: draft config {a}, target config {b}")
    need = max_model_len or context_length(target_config)
    have = context_length(draft_config)
    if need is not None and have is not None and have < need:
        raise ExportError(
            f"context length: the draft reaches {have} positions, the server runs {need} "
            f"(serve with --max-model-len {have} or below)"
        )
    allowed = HEAD_DIMS[backend]
    dims = {"draft": head_dim(draft_config), "target": head_dim(target_config)}
    for who, dim in dims.items():
        if allowed is not None and dim not in allowed:
            raise ExportError(
                f"head_dim {dim} of the {who} is not supported by {backend} (supported: {list(allowed)})"
            )
    for who, cfg in (("draft", draft_config), ("target", target_config)):
        heads = cfg.num_attention_heads
        if tp > 1 and heads % tp:
            raise ExportError(
                f"tensor parallel {tp}: the {who}'s {heads} attention heads do not split evenly over {tp} GPUs"
            )
    return {
        "backend": backend,
        "vocab_size": target_config.vocab_size,
        "head_dim": dims,
        "context": {"draft": have, "target": context_length(target_config), "max_model_len": need},
        "special_tokens": {n: getattr(target_tok, n, None) for n in SPECIAL_TOKENS},
    }


def serve_commands(
    target: str,
    draft_dir: str,
    k: int,
    tp: int = 1,
    port: int = 8000,
    dtype: str = "auto",
    venv: str = ".venv-vllm",
) -> dict[str, str]:
    """Exact serve commands for vLLM (CPU, GPU, GPU tensor-parallel) and SGLang, target + this draft."""
    spec = json.dumps({"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k})
    spec_prob = json.dumps(
        {
            "method": "draft_model",
            "model": draft_dir,
            "num_speculative_tokens": k,
            "draft_sample_method": "probabilistic",
        }
    )
    q = shlex.quote
    cpu = (
        f"VLLM_CPU_KVCACHE_SPACE=1 {venv}/bin/python -m vllm.entrypoints.openai.api_server "
        f"--model {q(target)} --dtype float32 --host 127.0.0.1 --port {port} --speculative-config {q(spec_prob)}"
    )
    gpu = f"vllm serve {q(target)} --dtype {dtype} --port {port} --speculative-config {q(spec_prob)}"
    gpu_tp = gpu + f" --tensor-parallel-size {tp}"
    sglang = (
        f"python -m sglang.launch_server --model-path {q(target)} --port {port} "
        f"--speculative-algorithm STANDALONE --speculative-draft-model-path {q(draft_dir)} "
        f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
    )
    return {
        "vllm_cpu": cpu,
        "vllm_cpu_greedy_drafting": cpu.replace(q(spec_prob), q(spec)),
        "vllm_gpu": gpu,
        "vllm_gpu_tp": gpu_tp,
        "sglang_gpu": sglang,
        "sglang_gpu_tp": sglang + f" --tp {tp}",
    }


def _serve_md(target: str, out_dir: Path, commands: dict[str, str], checks: dict, tp: int) -> str:
    lines = [
        f"# Serving this draft ({out_dir.name}) with target `{target}`",
        "",
        f"Checked for backend `{checks['backend']}`: vocabulary {checks['vocab_size']}, "
        f"head_dim {checks['head_dim']}, context {checks['context']}.",
        "",
        "## vLLM on CPU (isolated venv from scripts/setup_vllm.sh; the `vllm` command does not work with vllm-cpu)",
        "",
        "```bash",
        commands["vllm_cpu"],
        "```",
        "",
        "Greedy drafting (vLLM's default: exact, but few draft tokens accepted at T > 0):",
        "",
        "```bash",
        commands["vllm_cpu_greedy_drafting"],
        "```",
        "",
        "Caveat: vllm-cpu's speculative path samples off-distribution at T > 0 as shipped (vllm-project/vllm#55005);",
        "T = 0 is exact.",
        "",
        "## vLLM on GPU (not run here)",
        "",
        "```bash",
        commands["vllm_gpu"],
        f"# tensor parallel over {tp} GPUs",
        commands["vllm_gpu_tp"],
        "```",
        "",
        "## SGLang standalone draft (not run here)",
        "",
        "```bash",
        commands["sglang_gpu"],
        commands["sglang_gpu_tp"],
        "```",
        "",
    ]
    return "\n".join(lines)


def _load_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def export_draft(
    draft: str,
    target: str,
    out_dir: str | Path,
    adapter: str | None = None,
    backend: str | None = None,
    k: int = 2,
    tp: int = 1,
    max_model_len: int | None = None,
    dtype: str = "auto",
    world=None,
) -> ExportResult:
    """Check, then write `out_dir` (atomically): the draft (with `adapter` merged, if given) as safetensors, the
    tokenizer, SERVE.md and serve_commands.txt, export.json. `draft`/`target`: local folders, hub names or
    `world:...`. With an adapter, `draft` is its base model. backend: None = this machine's (default_backend)."""
    import torch
    from transformers import AutoModelForCausalLM

    if is_head_dir(draft):  # a draft head: vLLM's eagle3 layout (resispec/models/head_export.py)
        return export_head(draft, target, out_dir, backend=backend, k=max(k, 1), world=world)
    backend = backend or default_backend()
    draft_path = resolve_model_path(draft, world)
    target_path = resolve_model_path(target, world)
    target_config, target_tok = _load_config(target_path), load_tokenizer(target_path)
    draft_config, draft_tok = _load_config(draft_path), load_tokenizer(draft_path)
    checks = check_compatible(draft_config, draft_tok, target_config, target_tok, backend, max_model_len, tp)

    kwargs = {} if dtype == "auto" else {"dtype": getattr(torch, dtype)}
    model = AutoModelForCausalLM.from_pretrained(draft_path, **kwargs)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = Path(out_dir).resolve()
    tmp = out.with_name(TMP_PREFIX + out.name)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    target_tok.save_pretrained(tmp)  # equal to the draft's (checked); the engines read the target's anyway
    commands = serve_commands(target_path, str(out), k, tp=tp, dtype=dtype)
    (tmp / "SERVE.md").write_text(_serve_md(target_path, out, commands, checks, tp))
    (tmp / "serve_commands.txt").write_text("".join(f"# {name}\n{cmd}\n\n" for name, cmd in commands.items()))
    meta = {"draft": draft_path, "adapter": adapter, "target": target_path, "k": k, "checks": checks}
    (tmp / "export.json").write_text(json.dumps(meta, indent=2, default=str))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return ExportResult(out, checks, commands)
