"""Export a trained draft head (resispec/models/head.py) for vLLM's `eagle3` method and SGLang's EAGLE3: the
EAGLE / SpecForge checkpoint layout (docs/eagle3_notes.md section 4a).

Files: config.json (a Llama config: `architectures: ["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`,
`vocab_size` = the target's, `draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` at the top
level and in `eagle_config` with `use_aux_hidden_state`, `norm_before_residual: false` written explicitly (vLLM's
speculators parser defaults it to true), `rope_theta` and `max_position_embeddings` written explicitly),
model.safetensors with EAGLE's keys (fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t int64 [N], t2d bool [V];
no d2t / t2d for a full vocabulary, which vLLM refuses; no embed_tokens: vLLM shares the target's, the head's width
being the target's), the target's tokenizer, SERVE.md,
serve_commands.txt and export.json.

Checked first (one line each, `ExportError`): the head was trained for this target (vocabulary, width), exactly 3
aux layer ids (vLLM's fc reads 3 x target_hidden_size), sorted (vLLM sorts them) and below the target's depth (vLLM's
id k = HF hidden_states[k] for k < L), the head sizes the backend's attention takes, d2t/t2d/lm_head shapes.
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
from resispec.models.loading import load_tokenizer, resolve_model_path

VLLM_AUX_LAYERS = 3  # vLLM's Eagle3 fc: Linear(3 * target_hidden_size, hidden_size)


def check_head(head_cfg: dict, state: dict, target_config, backend: str) -> dict:
    """Raise ExportError (one line) unless the head fits the target on `backend`; returns what was checked."""
    if backend not in HEAD_DIMS:
        raise ExportError(f"unknown backend {backend!r}; use one of {sorted(HEAD_DIMS)}")
    vocab, width = target_config.vocab_size, target_config.hidden_size
    if head_cfg["vocab_size"] != vocab or head_cfg.get("target_hidden_size") != width:
        raise ExportError(
            f"the head was trained for a target of vocabulary {head_cfg['vocab_size']} and width "
            f"{head_cfg.get('target_hidden_size')}; this target has {vocab} and {width}"
        )
    ids = list(head_cfg["eagle_aux_hidden_state_layer_ids"])
    num_layers = target_config.num_hidden_layers
    if len(ids) != VLLM_AUX_LAYERS or len(set(ids)) != len(ids):
        raise ExportError(
            f"vLLM's eagle3 fuses exactly {VLLM_AUX_LAYERS} distinct target layers; this head reads {ids} "
            f"(a {num_layers}-layer target: train with draft.head.layers=[a,b,c])"
        )
    if ids != sorted(ids) or not all(0 <= i < num_layers for i in ids):
        raise ExportError(
            f"aux layer ids {ids} must be sorted and in 0..{num_layers - 1} (vLLM's convention)"
        )
    n, h = head_cfg["draft_vocab_size"], head_cfg["hidden_size"]
    shapes = {
        "fc.weight": (h, VLLM_AUX_LAYERS * width),
        "lm_head.weight": (n, h),
        "d2t": (n,),
        "t2d": (vocab,),
        "midlayer.self_attn.q_proj.weight": (head_cfg["num_attention_heads"] * head_cfg["head_dim"], 2 * h),
    }
    for key, shape in shapes.items():
        if key not in state or tuple(state[key].shape) != shape:
            got = tuple(state[key].shape) if key in state else "missing"
            raise ExportError(f"head weight {key}: {got}, expected {shape}")
    import torch

    if state["d2t"].dtype != torch.int64 or state["t2d"].dtype != torch.bool or int(state["t2d"].sum()) != n:
        raise ExportError("d2t must be int64 offsets and t2d a bool mask with draft_vocab_size members")
    allowed = HEAD_DIMS[backend]
    dims = {"head": int(head_cfg["head_dim"]), "target": head_dim(target_config)}
    for who, dim in dims.items():
        if allowed is not None and dim not in allowed:
            raise ExportError(
                f"head_dim {dim} of the {who} is not supported by {backend} (supported: {list(allowed)})"
            )
    return {
        "backend": backend,
        "vocab_size": vocab,
        "draft_vocab_size": n,
        "aux_layer_ids": ids,
        "head_dim": dims,
        "target_layers": num_layers,
    }


def eagle3_config(head_cfg: dict) -> dict:
    """config.json of the EAGLE / SpecForge layout from the head's own config."""
    cfg = {k: v for k, v in head_cfg.items() if not k.startswith("_") and k != "resispec_head"}
    rope = cfg.get("rope_parameters") or {}
    ids = list(head_cfg["eagle_aux_hidden_state_layer_ids"])
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        norm_before_residual=False,
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        eagle_aux_hidden_state_layer_ids=ids,
        eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        tie_word_embeddings=False,
    )
    return cfg


def head_serve_commands(target: str, out: str, k: int) -> dict[str, str]:
    spec = json.dumps({"method": "eagle3", "model": out, "num_speculative_tokens": k})
    return {
        "vllm": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}",
        "sglang": (
            f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {shlex.quote(out)} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
        ),
    }


def export_head(
    head: str | Path,
    target: str,
    out_dir: str | Path,
    backend: str | None = None,
    k: int = 3,
    world=None,
) -> ExportResult:
    """Check, then write `out_dir` atomically (module docstring). head: a head folder (a run's draft/)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    backend = backend or default_backend()
    head_dir, target_path = Path(head), resolve_model_path(target, world)
    head_cfg = json.loads((head_dir / "config.json").read_text())
    state = load_file(str(head_dir / "model.safetensors"))
    target_config = AutoConfig.from_pretrained(target_path)
    checks = check_head(head_cfg, state, target_config, backend)
    out = Path(out_dir).resolve()
    tmp = out.with_name(TMP_PREFIX + out.name)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # a full vocabulary has no id map: vLLM (0.32) then builds no draft_id_to_target_id and refuses a d2t
    full = checks["draft_vocab_size"] == checks["vocab_size"]
    save_file(
        {k: v.contiguous() for k, v in state.items() if not (full and k in ("d2t", "t2d"))},
        str(tmp / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (tmp / "config.json").write_text(json.dumps(eagle3_config(head_cfg), indent=2, sort_keys=True) + "\n")
    load_tokenizer(target_path).save_pretrained(tmp)
    commands = head_serve_commands(target_path, str(out), k)
    (tmp / "serve_commands.txt").write_text("".join(f"# {name}\n{cmd}\n\n" for name, cmd in commands.items()))
    (tmp / "SERVE.md").write_text(
        f"# Serving the draft head with {target_path}\n\nChecked for `{backend}`: aux layers "
        f"{checks['aux_layer_ids']}, draft vocabulary {checks['draft_vocab_size']} of {checks['vocab_size']}, "
        f"head_dim {checks['head_dim']}. vLLM drafts chains only (num_speculative_tokens = k).\n\n"
        + "".join(f"{name}:\n\n    {cmd}\n\n" for name, cmd in commands.items())
    )
    meta = {"head": str(head_dir), "target": target_path, "k": k, "format": "eagle3", "checks": checks}
    (tmp / "export.json").write_text(json.dumps(meta, indent=2, default=str))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return ExportResult(out, checks, commands)
