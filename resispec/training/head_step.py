"""The training step of a draft head (draft.kind=head, resispec/models/head.py), called from the distillation loop.

One micro-batch: ONE target forward gives both its rows at the response positions (the hidden states the loss turns
into logits chunk by chunk, `Rows`) and the states entering the head's layers (output_hidden_states); the head's
training-time test unrolls `ttt_steps` steps (DraftHead.ttt: step 0 on the fused target features, step j on its own
outputs of step j-1, teacher-forced tokens). Step j's output at index i predicts token i+2+j, the token the
target's logits at position i+1+j predict, so step j is scored at every response position t with t-1-j >= 0 against
the target's row t, with the configured loss (resispec.losses.distill_loss_rows: every loss of losses.py, forward KL
by default) and the positions' weights; the steps are weighted step_decay ** j and averaged with those weights.
A reduced draft vocabulary scores the target restricted to it (its LM head rows of the draft ids, renormalised),
and only at positions whose target argmax is in it (EAGLE-3's mask: elsewhere the restricted target says little of
what the target will emit).
"""

from __future__ import annotations

import torch

from resispec.errors import UserError
from resispec.losses import (
    Rows,
    TargetSignal,
    acceptance,
    distill_loss_rows,
    fkl,
    head_swapped,
    loss_weights,
    response_index,
)
from resispec.models.head import DraftHead
from resispec.sampling import log_probs
from resispec.training.evaluation import simulate_tau
from resispec.verify import build_rule


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
    responses' tokens. Its initialisation seed comes from torch's generator, which the loop seeds with train.seed
    (so seeds differ in the head's start as in the data order)."""
    cfg = draft_cfg.head
    counts = None
    if cfg.draft_vocab_size and train_rows is not None:
        counts = torch.zeros(target.config.vocab_size, dtype=torch.float64)
        for row in train_rows:
            ids = torch.as_tensor(list(row["response_ids"]), dtype=torch.long)
            counts += torch.bincount(ids, minlength=counts.numel())[: counts.numel()].double()
    return DraftHead.from_target(
        target,
        cfg.layers,
        cfg.draft_vocab_size,
        cfg.intermediate_size,
        token_counts=counts,
        seed=int(torch.randint(2**31 - 1, ())),
    )


def in_draft_vocab(head, target_rows: Rows, chunk: int = 1024) -> torch.Tensor:
    """[N] bool: the target's argmax token of each row is in the head's draft vocabulary (t2d), the full-vocabulary
    logits built `chunk` rows at a time."""
    with torch.no_grad():
        top = [target_rows.logits(slice(s, s + chunk)).argmax(-1) for s in range(0, len(target_rows), chunk)]
    return head.t2d[torch.cat(top)] if top else torch.zeros(0, dtype=torch.bool, device=head.t2d.device)


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
    if head.reduced:  # EAGLE-3's mask: no loss where the target's argmax is outside the draft vocabulary
        weights = weights * in_draft_vocab(head, Rows(t_rows, lm_head.weight, lm_head.bias, half)).to(
            weights.dtype
        )
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


# ---------------------------------------------------------------- held-out evaluation of a head, depth by depth
@torch.no_grad()
def head_heldout_logprobs(head, target, ids: torch.Tensor, num_prompt: int, depth: int, decode):
    """(log p [R, V], [log q_d [R, V] for d < depth]) of one held-out sequence (prompt + response, R response
    tokens): the target's row t (predicting token t+1) and, for the same token, the head's training-time-test step
    d at index t-1-d, i.e. the depth-d node of a chain rooted at t-d whose ancestors are the sequence's own
    tokens (the unroll equals decoding on every tree node: tests/unit/test_head.py). Rows whose index would be
    negative (a prompt shorter than the depth) reuse index 0. Both after the decode processing (resispec.sampling
    .log_probs)."""
    x = ids.to(head.device)[None]
    out = target(input_ids=x, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in head.layers], dim=-1)
    rows = torch.arange(
        num_prompt - 1, x.shape[1] - 1, device=x.device
    )  # target rows predicting the response
    log_p = log_probs(out.logits[0, rows], decode.temperature, decode.top_k, decode.top_p)
    outs = head.ttt(feats, x, depth)
    log_q = [
        log_probs(
            head.target_logits(h[0, (rows - 1 - d).clamp(min=0)]),
            decode.temperature,
            decode.top_k,
            decode.top_p,
        )
        for d, h in enumerate(outs)
    ]
    return log_p, log_q


@torch.no_grad()
def evaluate_head(run) -> dict:
    """`resispec.training.evaluation.evaluate`'s metrics for a head, with each depth scored by its own unroll step
    (`head_heldout_logprobs`; a standalone draft's depths all read the same q): alpha per rule and n and fkl of
    depth 0, per-depth acceptance and simulated tau along decode.fixed_tree. Every process evaluates every
    sequence (the head is small), so all return the same metrics."""
    acc, job = run.accelerator, run.job
    decode = job.decode
    tree = [int(n) for n in decode.fixed_tree]
    ns = sorted(set(tree))
    head = acc.unwrap_model(run.draft)
    was_training = head.training
    head.eval()
    rule_objs = {r: build_rule(r, decode.auto_policy) for r in run.rules}
    lengths, fkls = [], []
    first = {r: {n: [] for n in ns} for r in run.rules}  # depth 0 at every n: [rule][n] -> [R] per sequence
    deeper = {r: [[] for _ in tree[1:]] for r in run.rules}  # depth d >= 1 at its own n: [rule][d-1]
    for ids, num_prompt in run.eval_seqs:
        with acc.autocast():
            log_p, log_q = head_heldout_logprobs(head, run.target, ids, num_prompt, len(tree), decode)
        log_p, log_q = log_p.float(), [q.float() for q in log_q]
        lengths.append(log_p.shape[0])
        fkls.append(fkl(log_p, log_q[0]).cpu())
        p = log_p.exp()
        for d, lq in enumerate(log_q):
            q = lq.exp()
            for r, rule in rule_objs.items():
                if d == 0:
                    for n in ns:
                        first[r][n].append(acceptance(rule, p, q, n).float().cpu())
                else:
                    deeper[r][d - 1].append(acceptance(rule, p, q, tree[d]).float().cpu())
    head.train(was_training)
    out: dict = {"num_positions": int(sum(lengths)), "fkl": torch.cat(fkls).mean().item()}
    out["alpha"], out["per_depth"], out["tau"] = {}, {}, {}
    for r in run.rules:
        by = {n: torch.cat(first[r][n]) for n in ns}
        out["alpha"][r] = {str(n): by[n].mean().item() for n in ns}
        per = [by[tree[0]], *(torch.cat(a) for a in deeper[r])]
        out["tau"][r], out["per_depth"][r] = simulate_tau(per, lengths)
    return out
