"""The training step of a draft head (draft.kind=head, resispec/models/head.py), called from the distillation loop.

One micro-batch: ONE target forward gives both its rows at the response positions (the hidden states the loss turns
into logits chunk by chunk, `Rows`) and the states entering the head's layers (output_hidden_states); the head's
training-time test unrolls `ttt_steps` steps (DraftHead.ttt: step 0 on the fused target features, step j on its own
outputs of step j-1, teacher-forced tokens). Step j's output at index i predicts token i+2+j, the token the
target's logits at position i+1+j predict, so step j is scored at every response position t with t-1-j >= 0 against
the target's row t, with the configured loss (resispec.losses.distill_loss_rows: every loss of losses.py, forward KL
by default) and the positions' weights; the steps are weighted step_decay ** j and averaged with those weights.
A reduced draft vocabulary scores the target restricted to it (its LM head rows of the draft ids, renormalised).
"""

from __future__ import annotations

import torch

from resispec.errors import UserError
from resispec.losses import (
    Rows,
    TargetSignal,
    distill_loss_rows,
    head_swapped,
    loss_weights,
    response_index,
)
from resispec.models.head import DraftHead


class HeadTrainingError(UserError, ValueError):
    """A setting a draft head cannot train with."""


def check_head_job(job) -> None:
    """Refuse, before any model loads, what a head cannot train with."""
    if job.train.target_signal != "online":
        raise HeadTrainingError(
            "draft.kind=head needs train.target_signal=online (the head reads the target's hidden states)"
        )
    if job.draft.adapter != "none":
        raise HeadTrainingError("draft.kind=head trains the whole head: set draft.adapter=none")
    if job.draft.head.ttt_steps < 1:
        raise HeadTrainingError(f"draft.head.ttt_steps must be >= 1, got {job.draft.head.ttt_steps}")


def build_head(target, draft_cfg, train_rows=None):
    """A fresh head on `target` (DraftHead.from_target) from draft.head; a reduced vocabulary counts the training
    responses' tokens."""
    cfg = draft_cfg.head
    counts = None
    if cfg.draft_vocab_size and train_rows is not None:
        counts = torch.zeros(target.config.vocab_size, dtype=torch.float64)
        for row in train_rows:
            ids = torch.as_tensor(list(row["response_ids"]), dtype=torch.long)
            counts += torch.bincount(ids, minlength=counts.numel())[: counts.numel()].double()
    return DraftHead.from_target(
        target, cfg.layers, cfg.draft_vocab_size, cfg.intermediate_size, token_counts=counts
    )


def head_micro_batch_loss(run, batch: dict[str, torch.Tensor], mask: torch.Tensor):
    """(loss, stats) of one micro-batch for a head (module docstring); batch already trimmed, mask [B, T-1]."""
    acc, job = run.accelerator, run.job
    head = acc.unwrap_model(run.draft)
    ids = batch["input_ids"]
    bsz, seq = ids.shape
    index = response_index(mask, seq)  # flat b * T + t of the response positions
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(acc.mixed_precision))
    target = run.target
    lm_head = target.get_output_embeddings()
    with acc.autocast(), torch.no_grad(), head_swapped(target, lm_head, index, hidden_only=True):
        out = target(input_ids=ids, attention_mask=batch["attention_mask"], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in head.layers], dim=-1).detach()
    t_rows = out.logits.detach()  # [N, H]: the target's final hidden states at the response positions
    weight = lm_head.weight if not head.reduced else lm_head.weight[head.draft_to_target]
    bias = (
        None if lm_head.bias is None else lm_head.bias[head.draft_to_target if head.reduced else slice(None)]
    )
    weights = loss_weights(mask, job.loss, job.decode)[mask.bool()]  # [N]
    cfg = job.draft.head
    with acc.autocast():
        outs = run.draft(input_ids=ids, features=feats, ttt_steps=cfg.ttt_steps)  # [B, T, H] per step
    t = index % seq
    total, w_total, stats = 0.0, 0.0, None
    for j, h in enumerate(outs):
        valid = t - 1 - j >= 0
        if not bool(valid.any()):
            break
        rows = head.norm(h).reshape(bsz * seq, -1)[index[valid] - 1 - j]
        draft = Rows(rows, head.lm_head.weight, None, half)
        sig = TargetSignal(Rows(t_rows[valid], weight, bias, half))
        value, step_stats = distill_loss_rows(draft, sig, weights[valid], job.loss, job.decode)
        w = cfg.step_decay**j
        total, w_total = total + w * value, w_total + w
        stats = stats or step_stats  # fkl of step 0 (what the standalone draft logs)
    return total / max(w_total, 1e-12), stats
