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
from collections.abc import Callable
from dataclasses import dataclass

import torch

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


@dataclass
class TargetSignal:
    """The target side at the loss positions. Dense (online): `values` are the raw logits [..., V], `ids` None;
    the loss applies the decode processing. Sparse (cached): `values` are the log-probs of the K most likely
    tokens [..., K], already temperature-scaled and sorted by decreasing probability, with their `ids` [..., K];
    the tail mass is 1 - sum(exp(values))."""

    values: Tensor  # [..., V] logits or [..., K] log-probs
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
    loss: LossConfig, decode: DecodeConfig, served: tuple[Tensor, Tensor] | None = None
) -> list[tuple[int, float]]:
    """(n, weight) pairs the acceptance losses average alpha over. `loss.draws=root`: the root's n only.
    `loss.draws=tree`: every depth d of the tree with weight depth_decay**d (normalised), grouped by n. Any
    response position can sit at any depth of a future tree, and in the default [4, 2, 1, 1] half the depths are
    one-draft chains, where alpha(n=4) says nothing about what gets accepted. `loss.draws=reach`: depth d weighs
    d tau / d a_d at the batch's current acceptances (`reach_weights`; needs the `served` log-prob pair, without
    it the tree's n weigh the same, which is enough to check the rules have closed forms)."""
    if loss.draws == "root":
        return [(residual_num_draws(loss, decode), 1.0)]
    if loss.draws not in ("tree", "reach"):
        raise ValueError(f"loss.draws must be root, tree or reach, got {loss.draws!r}")
    tree = [int(n) for n in decode.fixed_tree]
    if loss.draws == "reach" and served is not None:
        rule, (log_p, log_q) = residual_rule(loss, decode), served
        with torch.no_grad():
            mean_alpha = {n: acceptance(rule, log_p.exp(), log_q.exp(), n).mean().item() for n in set(tree)}
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


def residual_weighted_fkl(log_p: Tensor, log_q: Tensor, alpha: Tensor) -> Tensor:
    """fkl re-weighted per position by the residual mass 1 - alpha that verification leaves there (detached,
    normalised to mean 1 over the batch): fkl's dense, well-conditioned gradient, spent where verification
    fails instead of on positions the tree already accepts. alpha: [N] served acceptance. -> [N]"""
    w = (1.0 - alpha).detach().clamp_min(0.0)
    return w / w.mean().clamp_min(_TINY) * fkl(log_p, log_q)


Pair = tuple[Tensor, Tensor]
# name -> per-position loss [N] from (untruncated pair, served pair, loss config, decode config). The divergences
# use the untruncated pair only; the acceptance losses take alpha on the served one.
PositionLoss = Callable[[Pair, Pair, LossConfig, DecodeConfig], Tensor]

LOSSES: dict[str, PositionLoss] = {
    "fkl": lambda full, served, c, d: fkl(*full),
    "rkl": lambda full, served, c, d: rkl(*full),
    "jsd": lambda full, served, c, d: jsd(*full, c.jsd_beta),
    "tvd": lambda full, served, c, d: tvd(*full),
    "residual": lambda full, served, c, d: residual(
        *full,
        rule=build_rule(residual_rule(c, d), d.auto_policy),
        n=residual_draws(c, d, served),
        form=c.form,
        fkl_weight=c.fkl_weight,
        served=served,
    ),
    "lk": lambda full, served, c, d: lk(*full, served, form=c.form, eta=c.lk_eta),
    "fkl_residual": lambda full, served, c, d: residual_weighted_fkl(
        *full, served_alpha(served, residual_rule(c, d), residual_draws(c, d, served))
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
    where stats carries the mean unweighted fkl for reference."""
    fn = LOSSES[loss.name]
    # with draws=tree the depth weights live inside the residual loss; positions then weigh the same
    tree_weighted = loss.name in ("residual", "fkl_residual") and loss.draws != "root"
    weights = position_weights(
        loss_mask, 1.0 if tree_weighted else loss.depth_decay, len(decode.fixed_tree)
    )  # [B, T]
    sel = loss_mask.bool()  # only the response positions are computed: they are all the loss needs
    q_logits = draft_logits[sel]  # [N, V]
    tgt = TargetSignal(target.values[sel], None if target.ids is None else target.ids[sel])
    w = weights[sel]  # [N]
    if q_logits.shape[0] == 0:  # a batch with no response token: a zero that keeps the graph
        return draft_logits.sum() * 0.0, {"fkl": 0.0, "num_positions": 0}
    full = paired_logprobs(tgt, q_logits, decode, truncate=False)
    truncates = loss.name in ACCEPTANCE_LOSSES and (decode.top_k > 0 or decode.top_p < 1.0)
    served = paired_logprobs(tgt, q_logits, decode, truncate=True) if truncates else full
    per_pos = fn(full, served, loss, decode)  # [N]
    value = (per_pos * w).sum() / w.sum().clamp_min(_TINY)
    ref = fkl(*full).detach().mean().item()
    return value, {"fkl": ref, "num_positions": int(q_logits.shape[0])}
