"""Distillation losses: the standard divergences and the residual (acceptance) losses built on resispec.verify.

Every loss compares p (target) and q (draft) at the positions of the response tokens (`loss_mask`), after the
SAME processing the decoder applies (`resispec.sampling`: the decoder uses its `probs` view, the losses
its `log_probs` view):

- temperature: both sides are divided by `decode.temperature`; temperature 0 (greedy serving) trains at 1,
  because a greedy target has no distribution to match and a temperature-1 match is what makes the argmaxes agree;
- top-k / top-p: applied (each side to itself, as the decoder does) ONLY for the residual loss, whose value is
  the served acceptance. The divergences skip them: independent truncation of p and q makes fkl/rkl infinite
  wherever one side was cut and the other was not.

The target can be dense (full logits, the `online` signal) or sparse (the `cached` signal: top-K log-probs plus
one "tail" bucket holding the rest of the mass). In the sparse case q is mapped onto the same K+1 buckets, so p
and q are distributions on one support and every loss is computed there. Merging the tail tokens into one bucket
makes the tail look like a perfect match, so the sparse losses are a (tight for small tails) approximation.

The residual loss is 1 - alpha_rule(p, q, n) from the rule's `surrogate_acceptance` (resispec.verify; the closed
form itself for every rule that has one): no second copy of any formula.
The rule's internal constants (T*, rho*) are solved under no_grad there, so only q carries the gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from resispec.decoding.config import DecodeConfig
from resispec.sampling import log_probs, nucleus_drop
from resispec.verify import VERIFIERS, VerificationRule, build_rule, covers

Tensor = torch.Tensor
_TINY = 1e-12


@dataclass
class LossConfig:
    """`name`: fkl | rkl | jsd | tvd | residual | lk | fkl_residual. The residual loss is 1 - alpha_rule(p, q, n)
    with rule and n from the decode config (`rule: null` = decode.rule); `form` picks the plain, -log or
    fkl-hybrid variant. `lk`: the LK losses (form lambda | log | log_lambda, blend rate lk_eta). `fkl_residual`:
    fkl weighted per position by 1 - alpha_rule (rule and draws as for residual)."""

    name: str = "residual"
    rule: str | None = None
    # plain (1 - alpha) | log (-log alpha) | hybrid (1 - alpha + fkl_weight * fkl) | log_hybrid
    form: str = "hybrid"
    num_draws: int | None = None  # n for alpha_rule(p, q, n); null = decode.tree[0] (the root's branching)
    # root: alpha at n = num_draws | tree: mean of alpha(n_d) over the tree's depths d | reach: depth d weighted by
    # d tau / d alpha_d at the batch's acceptances
    draws: str = "root"
    fkl_weight: float = 0.1
    jsd_beta: float = 0.5
    # position t of a response weighs depth_decay ** (t mod len(tree)); with draws=tree, depth d of the tree weighs
    # depth_decay ** d instead (positions then all weigh 1); 1 = off
    depth_decay: float = 1.0
    lk_eta: float = 3.0  # lk: lambda = exp(-lk_eta * alpha) blends KL (small alpha) into the acceptance term
    # response positions per chunk of the loss: no more than chunk_size x V float32 values (plus a few copies) are
    # alive at once; 0 = all positions in one chunk. The value and gradients do not depend on it
    chunk_size: int = 256


@dataclass
class Rows:
    """Logits of N positions, given as such (`x` [N, V], `weight` None) or as the final hidden states `x` [N, H]
    and the LM head (`weight` [V, H], `bias` [V] or None), so that the loss computes the logits one chunk of rows at
    a time and never holds all N x V. `autocast`: the dtype the head's matmul runs in (the run's mixed precision,
    as inside the model's forward), None = the tensors' own."""

    x: Tensor
    weight: Tensor | None = None
    bias: Tensor | None = None
    autocast: torch.dtype | None = None

    def __len__(self) -> int:
        return self.x.shape[0]

    def logits(self, sl: slice) -> Tensor:
        """[n, V] logits of rows `sl` (in the graph of x / weight when grad is enabled)."""
        if self.weight is None:
            return self.x[sl]
        dev = self.x.device.type
        with torch.autocast(dev, dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            return F.linear(self.x[sl], self.weight, self.bias)

    def leaves(self) -> list[Tensor]:
        """The tensors the loss differentiates (those requiring grad)."""
        return [t for t in (self.x, self.weight, self.bias) if t is not None and t.requires_grad]


@dataclass
class TargetSignal:
    """The target side at the loss positions. Dense (online): `values` are the raw logits [..., V], `ids` None;
    the loss applies the decode processing. Sparse (cached): `values` are the log-probs of the K most likely
    tokens [..., K], already temperature-scaled and sorted by decreasing probability, with their `ids` [..., K];
    the tail mass is 1 - sum(exp(values))."""

    values: Tensor | Rows  # [..., V] logits (or Rows: hidden states x the head) or [..., K] log-probs
    ids: Tensor | None = None  # [..., K]

    @property
    def sparse(self) -> bool:
        return self.ids is not None


def filter_sparse(logprobs: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Top-k / top-p on a sparse target: log-probs [N, K+1], the last column the tail bucket; the K columns
    are sorted by decreasing probability, so the cut is exact unless the nucleus reaches into the tail, which is
    then kept as one bucket. Returns renormalised log-probs [N, K+1]."""
    keep_len = logprobs.shape[-1] - 1
    drop = torch.zeros_like(logprobs, dtype=torch.bool)
    if top_k and top_k < keep_len + 1:
        drop[..., top_k:] = True  # top_k <= K drops the tail as well
    if top_p < 1.0:
        drop |= nucleus_drop(logprobs.exp(), top_p)  # the decoder's drop rule (columns already sorted)
    return logprobs.masked_fill(drop, float("-inf")).log_softmax(-1)


def sparse_with_tail(logprobs: Tensor) -> Tensor:
    """Top-K log-probs [N, K] -> [N, K+1] with the tail bucket's log mass appended."""
    tail = (1.0 - logprobs.exp().sum(-1, keepdim=True)).clamp_min(_TINY)  # [N, 1]
    return torch.cat([logprobs, tail.log()], dim=-1)


def bucket_draft(draft_logprobs: Tensor, ids: Tensor) -> Tensor:
    """Map the draft onto the target's K+1 buckets: q at the top-K ids, and the rest as the tail.
    draft_logprobs: [N, V], ids: [N, K] -> [N, K+1] log-probs (differentiable)."""
    top = draft_logprobs.gather(-1, ids)  # [N, K]
    tail = (1.0 - top.exp().sum(-1, keepdim=True)).clamp_min(_TINY)  # [N, 1]
    return torch.cat([top, tail.log()], dim=-1)


def paired_logprobs(
    target: TargetSignal, draft_logits: Tensor, decode: DecodeConfig, truncate: bool
) -> tuple[Tensor, Tensor]:
    """(log p, log q) on one support, [N, S] each (S = V dense, K+1 sparse). `truncate` applies the decode
    top-k / top-p to both sides (residual loss, evaluation); the temperature is always applied."""
    top_k, top_p = (decode.top_k, decode.top_p) if truncate else (0, 1.0)
    log_q = log_probs(draft_logits, decode.temperature, top_k, top_p)  # [N, V]
    if not target.sparse:
        return log_probs(target.values, decode.temperature, top_k, top_p), log_q  # [N, V] each
    log_p = sparse_with_tail(target.values.float())  # [N, K+1]
    if truncate and (top_k or top_p < 1.0):
        log_p = filter_sparse(log_p, top_k, top_p)
    return log_p, bucket_draft(log_q, target.ids)


# ----------------------------------------------------------------------------- per-position losses
def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """KL(a || b) per row, with 0 log 0 = 0. [N, S] -> [N]."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def fkl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """Forward KL(p || q): mass-covering, the standard distillation loss. -> [N]"""
    return _kl(log_p, log_q)


def rkl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """Reverse KL(q || p): mode-seeking. -> [N]"""
    return _kl(log_q, log_p)


def jsd(log_p: Tensor, log_q: Tensor, beta: float = 0.5) -> Tensor:
    """Generalised Jensen-Shannon: beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q. -> [N]"""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd_beta must be in (0, 1), got {beta}")
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1.0 - beta))  # [N, S]
    return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)


def tvd(log_p: Tensor, log_q: Tensor) -> Tensor:
    """Total variation 1/2 sum |p - q| = 1 - sum min(p, q) (= 1 - alpha of the one-draft chain rule). -> [N]"""
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def residual_rule(loss: LossConfig, decode: DecodeConfig) -> str:
    """The rule whose acceptance the residual loss maximises: loss.rule, else decode.rule. Its
    `surrogate_acceptance` is the value (the closed form; resispec_auto: its i.i.d. branch's closed form on rows
    whose distinct branch has none)."""
    return loss.rule or decode.rule


def residual_num_draws(loss: LossConfig, decode: DecodeConfig) -> int:
    """n for the residual loss: loss.num_draws, else the root's branching decode.tree[0] (the node with the most
    candidates, where the rules differ most)."""
    return loss.num_draws or int(decode.fixed_tree[0])


def residual_draws(
    loss: LossConfig,
    decode: DecodeConfig,
    served: tuple[Tensor, Tensor] | None = None,
    mean_alpha: dict[int, float] | None = None,
) -> list[tuple[int, float]]:
    """(n, weight) pairs the acceptance losses average alpha over. `loss.draws=root`: the root's n only.
    `loss.draws=tree`: every depth d of the tree with weight depth_decay**d (normalised), grouped by n. Any
    response position can sit at any depth of a future tree, and in the default [4, 2, 1, 1] half the depths are
    one-draft chains, where alpha(n=4) says nothing about what gets accepted. `loss.draws=reach`: depth d weighs
    d tau / d a_d at the batch's current acceptances (`reach_weights`; needs the `served` log-prob pair, without
    it the tree's n weigh the same, which is enough to check the rules have closed forms). `mean_alpha` {n: the
    batch's mean acceptance}, when given, stands in for the one computed from `served` (the chunked loss computes
    it over all chunks first, `batch_constants`)."""
    if loss.draws == "root":
        return [(residual_num_draws(loss, decode), 1.0)]
    if loss.draws not in ("tree", "reach"):
        raise ValueError(f"loss.draws must be root, tree or reach, got {loss.draws!r}")
    tree = [int(n) for n in decode.fixed_tree]
    if loss.draws == "reach" and mean_alpha is None and served is not None:
        rule, (log_p, log_q) = residual_rule(loss, decode), served
        with torch.no_grad():
            mean_alpha = {n: acceptance(rule, log_p.exp(), log_q.exp(), n).mean().item() for n in set(tree)}
    if loss.draws == "reach" and mean_alpha is not None:
        depth_w = reach_weights([mean_alpha[n] for n in tree])
    else:
        decay = loss.depth_decay if loss.draws == "tree" else 1.0
        depth_w = [decay**d for d in range(len(tree))]
    weights: dict[int, float] = {}
    for n, w in zip(tree, depth_w, strict=True):
        weights[n] = weights.get(n, 0.0) + w
    total = sum(weights.values())
    return [(n, w / total) for n, w in sorted(weights.items())]


def reach_weights(alpha_by_depth: list[float]) -> list[float]:
    """d tau / d a_d for tau = 1 + sum_k prod_{d<k} a_d (the simulated tau of resispec.training.evaluation) at
    the given per-depth acceptances: how much one more unit of acceptance at depth d buys in accepted length.
    A depth counts as often as it is reached times what its acceptance unlocks below it."""
    depth = len(alpha_by_depth)
    grads = []
    for d in range(depth):
        reach = math.prod(alpha_by_depth[:d])  # P(depth d is reached)
        below, run = 0.0, 1.0  # sum over k > d of prod_{d < d' < k} a_d'
        for k in range(d + 1, depth + 1):
            below += run
            run *= alpha_by_depth[k] if k < depth else 0.0
        grads.append(reach * below)
    return grads


def acceptance(rule: str | VerificationRule, p: Tensor, q: Tensor, n: int) -> Tensor:
    """alpha_rule(p, q, n) [N] as training sees it: the rule's `surrogate_acceptance` from resispec.verify (the one
    implementation); p, q: [N, S] probabilities. `rule`: a name in VERIFIERS or a rule object (build_rule)."""
    if isinstance(rule, str):
        if rule not in VERIFIERS:
            raise ValueError(f"unknown rule {rule!r}; choose one of {sorted(VERIFIERS)}")
        rule = VERIFIERS[rule]
    return rule.surrogate_acceptance(p, q, n)


def served_alpha(served: tuple[Tensor, Tensor], rule: str, draws: list[tuple[int, float]]) -> Tensor:
    """Weighted acceptance sum_n w_n alpha_rule(p, q, n) on the served pair. -> [N]"""
    p, q = served[0].exp(), served[1].exp()
    return sum(w * acceptance(rule, p, q, n) for n, w in draws)


Pair = tuple[Tensor, Tensor]


def residual(
    log_p: Tensor,
    log_q: Tensor,
    *,
    rule: str | VerificationRule,
    n: int | list[tuple[int, float]],
    form: str,
    fkl_weight: float,
    served: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The residual loss per position [N]: plain 1 - alpha, `log` -log alpha (its gradient grows as alpha -> 0,
    where 1 - alpha's vanishes), `hybrid` 1 - alpha + fkl_weight * fkl (fkl keeps pulling q toward p's support
    where the acceptance gradient is flat), or `log_hybrid`. alpha is computed on `served` (the pair after the
    decode top-k / top-p) when given, fkl always on the untruncated (log_p, log_q). `n` is one draw count or
    (n, weight) pairs whose weighted alpha is used (see residual_draws)."""
    sp, sq = served if served is not None else (log_p, log_q)
    draws = [(n, 1.0)] if isinstance(n, int) else n
    alpha = served_alpha((sp, sq), rule, draws)  # [N]
    if form == "plain":
        return 1.0 - alpha
    if form == "log":
        return -alpha.clamp_min(1e-6).log()
    if form == "hybrid":
        return 1.0 - alpha + fkl_weight * fkl(log_p, log_q)
    if form == "log_hybrid":
        return -alpha.clamp_min(1e-6).log() + fkl_weight * fkl(log_p, log_q)
    raise ValueError(f"unknown residual loss form {form!r}; choose plain | log | hybrid | log_hybrid")


def chain_alpha(served: tuple[Tensor, Tensor]) -> Tensor:
    """alpha of the one-draft chain rule (sum min(p, q)) on a log-prob pair, from resispec.verify. -> [N]"""
    log_p, log_q = served
    return acceptance("chain", log_p.exp(), log_q.exp(), 1)


def lk(log_p: Tensor, log_q: Tensor, served: tuple[Tensor, Tensor], *, form: str, eta: float) -> Tensor:
    """The LK losses of Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative
    Decoding" (arXiv 2602.23881; Nebius's SpecForge pull request, also vLLM speculators' `lk_hybrid` / `nla`),
    reimplemented from that description, alpha the chain rule's acceptance sum min(p, q):
    `lambda` (their LK_lambda) lambda * KL(p||q) + (1 - lambda) * (1 - alpha) with lambda = exp(-eta * alpha)
    detached, so KL leads while the overlap is small (TV's gradient vanishes there) and TV takes over as alpha
    grows; `log` (their LK_alpha) -log alpha, TV's target with a 1 / alpha gradient boost; `log_lambda` the
    same adaptive blend with -log alpha in place of 1 - alpha (the hybrid this project's issue 14 names). -> [N]"""
    alpha = chain_alpha(served)
    if form == "log":
        return -alpha.clamp_min(1e-6).log()
    lam = torch.exp(-eta * alpha).detach()
    if form == "lambda":
        return lam * fkl(log_p, log_q) + (1 - lam) * (1 - alpha)
    if form == "log_lambda":
        return lam * fkl(log_p, log_q) - (1 - lam) * alpha.clamp_min(1e-6).log()
    raise ValueError(f"unknown lk loss form {form!r}; choose lambda | log | log_lambda")


def residual_weighted_fkl(log_p: Tensor, log_q: Tensor, alpha: Tensor, mean_w: float | None = None) -> Tensor:
    """fkl re-weighted per position by the residual mass 1 - alpha that verification leaves there (detached,
    normalised to mean 1 over the batch): fkl's dense, well-conditioned gradient, spent where verification
    fails instead of on positions the tree already accepts. alpha: [N] served acceptance; `mean_w`: the batch's
    mean weight when these N rows are one chunk of it (default: their own mean). -> [N]"""
    w = (1.0 - alpha).detach().clamp_min(0.0)
    norm = w.mean() if mean_w is None else torch.tensor(mean_w, dtype=w.dtype, device=w.device)
    return w / norm.clamp_min(_TINY) * fkl(log_p, log_q)


def residual_weight(served: Pair, loss: LossConfig, decode: DecodeConfig, consts: BatchConstants) -> Tensor:
    """fkl_residual's unnormalised per-position weight (1 - served alpha), clamped at 0. -> [N]"""
    draws = residual_draws(loss, decode, served, consts.mean_alpha)
    return (1.0 - served_alpha(served, residual_rule(loss, decode), draws)).clamp_min(0.0)


@dataclass
class BatchConstants:
    """The few batch-wide numbers a per-position loss reads (all detached), computed over every chunk before the
    loss itself (`batch_constants`): `mean_alpha` {n: mean acceptance} for draws=reach, `mean_w` fkl_residual's
    mean weight. None: the loss computes them from the rows it is given (the whole batch in one call)."""

    mean_alpha: dict[int, float] | None = None
    mean_w: float | None = None


# name -> per-position loss [N] from (untruncated pair, served pair, loss config, decode config, batch constants).
# The divergences use the untruncated pair only; the acceptance losses take alpha on the served one.
PositionLoss = Callable[[Pair, Pair, LossConfig, DecodeConfig, BatchConstants], Tensor]

LOSSES: dict[str, PositionLoss] = {
    "fkl": lambda full, served, c, d, k: fkl(*full),
    "rkl": lambda full, served, c, d, k: rkl(*full),
    "jsd": lambda full, served, c, d, k: jsd(*full, c.jsd_beta),
    "tvd": lambda full, served, c, d, k: tvd(*full),
    "residual": lambda full, served, c, d, k: residual(
        *full,
        rule=build_rule(residual_rule(c, d), d.auto_policy),
        n=residual_draws(c, d, served, k.mean_alpha),
        form=c.form,
        fkl_weight=c.fkl_weight,
        served=served,
    ),
    "lk": lambda full, served, c, d, k: lk(*full, served, form=c.form, eta=c.lk_eta),
    "fkl_residual": lambda full, served, c, d, k: residual_weighted_fkl(
        *full, served_alpha(served, residual_rule(c, d), residual_draws(c, d, served, k.mean_alpha)), k.mean_w
    ),
}
# losses that read the served acceptance: they see the decode top-k / top-p (the divergences do not)
ACCEPTANCE_LOSSES = ("residual", "lk", "fkl_residual")


def describe_loss(loss: LossConfig, decode: DecodeConfig) -> str:
    """A short label: `fkl`, `jsd(0.5)`, `residual[resispec n=4 hybrid 0.1]`, `residual[rrs tree log]`."""
    if loss.name == "jsd":
        return f"jsd({loss.jsd_beta})"
    if loss.name == "lk":
        return f"lk[{loss.form} eta={loss.lk_eta}]" if "lambda" in loss.form else f"lk[{loss.form}]"
    if loss.name not in ("residual", "fkl_residual"):
        return loss.name
    draws = loss.draws if loss.draws != "root" else f"n={residual_num_draws(loss, decode)}"
    if loss.name == "fkl_residual":
        return f"fkl_residual[{residual_rule(loss, decode)} {draws}]"
    form = f"{loss.form} {loss.fkl_weight}" if "hybrid" in loss.form else loss.form
    return f"residual[{residual_rule(loss, decode)} {draws} {form}]"


def check_loss_config(loss: LossConfig, decode: DecodeConfig) -> None:
    """Fail early, with one clear line, on a loss the run cannot compute."""
    if loss.name not in LOSSES:
        raise ValueError(f"unknown loss {loss.name!r}; choose one of {sorted(LOSSES)}")
    if loss.name in ("residual", "fkl_residual"):
        name = residual_rule(loss, decode)
        if name not in VERIFIERS:
            raise ValueError(f"unknown rule {name!r}; choose one of {sorted(VERIFIERS)}")
        rule = build_rule(name, decode.auto_policy)
        if not all(covers(rule.surrogate_draws, n) for n, _ in residual_draws(loss, decode)):
            raise ValueError(
                f"rule {name!r} has no closed-form acceptance, so the residual loss cannot target it; "
                "set loss.rule to a rule with one (e.g. resispec, rrs, kseq, hub, onehot)"
            )


# ----------------------------------------------------------------------------- masking and weights
def run_positions(loss_mask: Tensor) -> Tensor:
    """Index of each masked position within its contiguous run of masked positions (0 at a response's first
    predicted token). loss_mask: [B, T] -> [B, T] long."""
    m = loss_mask.long()
    idx = torch.arange(m.shape[1], device=m.device).expand_as(m)  # [B, T]
    # the last unmasked index at or before t (-1 if none): the start of the current run minus one
    last_zero = torch.where(m == 0, idx, torch.full_like(idx, -1)).cummax(dim=1).values
    return (idx - last_zero - 1).clamp_min(0)


def position_weights(loss_mask: Tensor, depth_decay: float, depth: int) -> Tensor:
    """Weights [B, T]: depth_decay ** (t mod depth) for the t-th response position, so positions that map to
    deeper tree levels count less (a deep node is only reached after all its ancestors were accepted)."""
    if depth_decay == 1.0 or depth <= 1:
        return loss_mask.float()
    t = run_positions(loss_mask) % depth
    return loss_mask.float() * depth_decay ** t.float()


def distill_loss(
    draft_logits: Tensor,  # [B, T, V] logits at the positions that predict the response tokens
    target: TargetSignal,  # dense [B, T, V] or sparse [B, T, K] (+ ids), same positions
    loss_mask: Tensor,  # [B, T] 1 where the position's next token is a response token
    loss: LossConfig,
    decode: DecodeConfig,
) -> tuple[Tensor, dict[str, float]]:
    """Masked, weighted mean of the configured loss over the response positions. Returns (loss, stats)
    where stats carries the mean unweighted fkl for reference. The rows are selected here; the loss itself is
    `distill_loss_rows` (chunked)."""
    sel = loss_mask.bool()  # only the response positions are computed: they are all the loss needs
    tgt = TargetSignal(target.values[sel], None if target.ids is None else target.ids[sel])
    if not sel.any():  # a batch with no response token: a zero that keeps the graph
        return draft_logits.sum() * 0.0, {"fkl": 0.0, "num_positions": 0}
    w = loss_weights(loss_mask, loss, decode)[sel]  # [N]
    return distill_loss_rows(Rows(draft_logits[sel]), tgt, w, loss, decode)


def loss_weights(loss_mask: Tensor, loss: LossConfig, decode: DecodeConfig) -> Tensor:
    """Per-position weights [B, T] of the configured loss (0 off the response)."""
    # with draws=tree the depth weights live inside the residual loss; positions then weigh the same
    tree_weighted = loss.name in ("residual", "fkl_residual") and loss.draws != "root"
    return position_weights(loss_mask, 1.0 if tree_weighted else loss.depth_decay, len(decode.fixed_tree))


def _chunks(n: int, size: int) -> list[slice]:
    size = size if size and size > 0 else max(n, 1)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _target_rows(target: TargetSignal, sl: slice) -> TargetSignal:
    values = target.values.logits(sl) if isinstance(target.values, Rows) else target.values[sl]
    return TargetSignal(values, None if target.ids is None else target.ids[sl])


def _pairs(target: TargetSignal, q_logits: Tensor, sl: slice, loss: LossConfig, decode: DecodeConfig):
    """(full, served) log-prob pairs of one chunk."""
    tgt = _target_rows(target, sl)
    full = paired_logprobs(tgt, q_logits, decode, truncate=False)
    truncates = loss.name in ACCEPTANCE_LOSSES and (decode.top_k > 0 or decode.top_p < 1.0)
    return full, (paired_logprobs(tgt, q_logits, decode, truncate=True) if truncates else full)


@torch.no_grad()
def batch_constants(
    draft: Rows, target: TargetSignal, loss: LossConfig, decode: DecodeConfig
) -> BatchConstants:
    """The batch-wide constants of the loss (`BatchConstants`), one no-grad pass over the chunks per constant
    needed (none for fkl, rkl, jsd, tvd, lk and the residual losses with draws=root or tree)."""
    consts, n_rows = BatchConstants(), len(draft)
    chunks = _chunks(n_rows, loss.chunk_size)

    def pairs() -> Iterator[Pair]:
        for sl in chunks:
            yield _pairs(target, draft.logits(sl), sl, loss, decode)[1]

    if loss.name in ("residual", "fkl_residual") and loss.draws == "reach":
        rule, ns = residual_rule(loss, decode), sorted({int(n) for n in decode.fixed_tree})
        sums = dict.fromkeys(ns, 0.0)
        for log_p, log_q in pairs():
            p, q = log_p.exp(), log_q.exp()
            for n in ns:
                sums[n] += float(acceptance(rule, p, q, n).double().sum())
        consts.mean_alpha = {n: s / n_rows for n, s in sums.items()}
    if loss.name == "fkl_residual":
        total = sum(float(residual_weight(served, loss, decode, consts).double().sum()) for served in pairs())
        consts.mean_w = total / n_rows
    return consts


class _WithGradients(torch.autograd.Function):
    """A value whose gradients with respect to `inputs` were computed already (chunk by chunk, in the forward):
    the backward only scales them by the incoming gradient, so nothing of the chunks' graphs is kept."""

    @staticmethod
    def forward(ctx, value: Tensor, n: int, *tensors: Tensor) -> Tensor:
        inputs, grads = tensors[:n], tensors[n:]
        ctx.dtypes = [t.dtype for t in inputs]
        ctx.save_for_backward(*grads)
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grads = [(g * grad_out).to(dt) for g, dt in zip(ctx.saved_tensors, ctx.dtypes, strict=True)]
        return (None, None, *grads, *[None] * len(grads))


def distill_loss_rows(
    draft: Rows, target: TargetSignal, weights: Tensor, loss: LossConfig, decode: DecodeConfig
) -> tuple[Tensor, dict[str, float]]:
    """The weighted mean of the configured loss over N response positions, computed `loss.chunk_size` rows at a
    time: draft logits [N, V] (or hidden states and the head, `Rows`), the target's rows (dense logits or `Rows`,
    or sparse top-K), weights [N]. Each chunk's logits, log-probs and loss are built, differentiated with
    respect to its logits and freed before the next chunk; the gradients of x (and of the head) are accumulated
    and handed to autograd at the end (`_WithGradients`), so at most one chunk's [n, V] working set is alive.
    The same value and gradients as one chunk of all N (batch-wide constants come from `batch_constants`).
    Returns (loss, {"fkl": mean unweighted forward KL (no grad), "num_positions": N})."""
    n_rows, fn = len(draft), LOSSES[loss.name]
    if n_rows == 0:
        zero = sum(t.sum() * 0.0 for t in draft.leaves()) if draft.leaves() else draft.x.sum() * 0.0
        return zero, {"fkl": 0.0, "num_positions": 0}
    consts = batch_constants(draft, target, loss, decode)
    w_sum = weights.sum().clamp_min(_TINY)
    leaves = draft.leaves() if torch.is_grad_enabled() else []
    x, weight, bias = draft.x, draft.weight, draft.bias
    wanted = lambda t: t is not None and any(t is leaf for leaf in leaves)  # noqa: E731
    gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if wanted(x) else None
    gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if wanted(weight) else None
    gb = torch.zeros(bias.shape, dtype=torch.float32, device=x.device) if wanted(bias) else None
    mm = draft.autocast or (weight.dtype if weight is not None else None)  # the dtype of the head's matmuls
    value = torch.zeros((), dtype=torch.float32, device=x.device)
    fkl_sum = 0.0
    for sl in _chunks(n_rows, loss.chunk_size):
        with torch.no_grad():
            q_logits = draft.logits(sl)
        with torch.enable_grad():
            q_leaf = q_logits.detach().requires_grad_(bool(leaves))
            full, served = _pairs(target, q_leaf, sl, loss, decode)
            per_pos = fn(full, served, loss, decode, consts)  # [n]
            part = (per_pos * weights[sl]).sum() / w_sum
            g = torch.autograd.grad(part, q_leaf)[0] if leaves else None  # [n, V]
        value += part.detach().float()
        with torch.no_grad():  # the logged fkl: the loss itself when it is fkl
            ref = per_pos if loss.name == "fkl" else fkl(full[0].detach(), full[1].detach())
            fkl_sum += float(ref.detach().double().sum())
        del full, served, part, per_pos, q_leaf
        if g is None:
            continue
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            if weight is None:
                gx[sl] = g
                continue
            if gx is not None:
                gx[sl] = (g.to(mm) @ weight.to(mm)).float()
            if gw is not None and mm == torch.float32:
                gw.addmm_(g.t().float(), x[sl].float())
            elif gw is not None:  # as autocast's backward would: the matmul in mm, accumulated in float32
                gw += g.t().to(mm) @ x[sl].to(mm)
            if gb is not None:
                gb += g.float().sum(0)
    stats = {"fkl": fkl_sum / n_rows, "num_positions": n_rows}
    if not leaves:
        return value, stats
    pairs = [(t, grad) for t, grad in ((x, gx), (weight, gw), (bias, gb)) if grad is not None]
    inputs, grads = [t for t, _ in pairs], [grad for _, grad in pairs]
    return _WithGradients.apply(value, len(inputs), *inputs, *grads), stats


# ----------------------------------------------------------------------------- a model's response rows
class _SelectRows(torch.nn.Module):
    """Stands in for a causal LM's head during one forward: returns the final hidden states of the selected
    positions only, [N, H] (flat indices into [B * T]), so the model computes no logits at all."""

    def __init__(self, index: Tensor):
        super().__init__()
        self.index = index

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden.reshape(-1, hidden.shape[-1])[self.index]


def _head_parent(model: torch.nn.Module, head: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    for module in model.modules():
        for name, child in module.named_children():
            if child is head:
                return module, name
    raise ValueError("the model's output embeddings are not one of its modules")


@contextmanager
def head_swapped(model: torch.nn.Module, head: torch.nn.Module, index: Tensor, hidden_only: bool):
    """Within the block, a forward of `model` (wrapped or not) computes only the rows `index`: the head replaced by
    `_SelectRows` (hidden_only: no logits), or, where the head must stay in place (a sharded model: FSDP or
    DeepSpeed gather its weights only inside the forward), a pre-hook that feeds it only those rows."""
    if hidden_only:
        parent, name = _head_parent(model, head)
        setattr(parent, name, _SelectRows(index))
        try:
            yield
        finally:
            setattr(parent, name, head)
        return
    hook = head.register_forward_pre_hook(lambda _m, args: (_SelectRows(index)(args[0]), *args[1:]))
    try:
        yield
    finally:
        hook.remove()


def response_index(loss_mask: Tensor, seq_len: int) -> Tensor:
    """Flat indices into [B * seq_len] of the positions whose next token is a response token; loss_mask [B, T']
    (T' <= seq_len, usually seq_len - 1: the last position predicts past the row). Row-major, so the rows line up
    with `tensor[loss_mask.bool()]`. -> [N] long"""
    sel = torch.zeros(loss_mask.shape[0], seq_len, dtype=torch.bool, device=loss_mask.device)
    sel[:, : loss_mask.shape[1]] = loss_mask.bool()
    return sel.flatten().nonzero().squeeze(1)


def model_rows(
    model: torch.nn.Module,
    inner: torch.nn.Module,
    batch: dict[str, Tensor],
    index: Tensor,
    fused: bool = True,
    autocast: torch.dtype | None = None,
) -> Rows:
    """The model's logits at the flat positions `index` of the batch (`response_index`), without the logits of any
    other position. `model` runs the forward (DDP / FSDP / peft / accelerate-wrapped as prepared); `inner` is the
    unwrapped model (`accelerator.unwrap_model`). `fused` (a model whose head is a plain Linear held whole on this
    process, no logit soft-capping): the forward stops at the hidden states [N, H] and the loss applies the head
    chunk by chunk (`Rows` with the head's weight). Otherwise the forward computes the [N, V] logits of those
    rows only. `autocast`: the dtype of the head's matmul (the run's mixed precision)."""
    head = inner.get_output_embeddings()
    plain = type(head) is torch.nn.Linear and not getattr(inner.config, "final_logit_softcapping", None)
    fused = fused and plain
    with head_swapped(inner, head, index, hidden_only=fused):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if not fused:
        return Rows(out)
    return Rows(out, head.weight, head.bias, autocast)
