"""ResiSpec shaping for DISTINCT draws (`resispec_wor`): the "Open problem" of docs/design.md.

Draws: n distinct tokens, sampled sequentially without replacement from q (base.draw_distinct: the law of
Gumbel-top-n).
Verification walks the draws in order. At draw i the state is a target residual p_i (a distribution) and
the current draw distribution q_i (q without the earlier draws, renormalised); k = draws left, counting this one.

Step with k >= 2 (shaped): accept x with probability clip(p_i(x) - lam * q_i(x), 0, q_i(x)) / q_i(x).
`lam` >= 0 holds mass back ("late filling") where the draft already covers it. Accepted mass c, residual
R = p_i - c, rejection mass r = q_i - c, with Σ R = Σ r. After rejecting x the residual MUST depend on x:
x can never be drawn again. We split R over the rejected token with a transport matrix M [x, z] (row sums r,
column sums R); the residual after rejecting x is the row M[x, :] / r(x). Two kinds of cells pay off:
- (x, z != x) up to K[x, z] = r(x) q_i(z) / (1 - q_i(x)): the next draw, from q_i without x, can accept it;
- the diagonal (x, x): that mass cannot be drawn again, but it is emitted at the end as x, and x IS a child.
  (This is what "stranded" mass in the sequential view really is: per-node α counts any emitted child.)
So M fills K column by column as far as R allows, then routes the leftovers onto the diagonal first:

    s = r / (1 - q_i),  kappa(z) = q_i(z) * (Σ s - s(z))      # column sums of K
    rho = min(1, R / kappa)                                   # scale each column of K down to fit R
    d = r - s * (Σ q_i rho - q_i rho),  e = (R - kappa)+      # row and column deficits, Σ d = Σ e
    M[x, z] = s(x) q_i(z) rho(z) [z != x] + min(d, e)(x) [z == x] + d'(x) e'(z) / Σ e'   (d', e': what is left)

Column sums of M are exactly R and row sums exactly r, so the rule is exact for ANY lam: lam only moves mass
between "accept now" and "accept later". Only the realised row M[x, :] is ever built (O(V) per draw).
The last draw (k = 1) is the greedy rsd step: accept w.p. min(1, p_i / q_i), else sample norm((p_i - q_i)+).

With n = 2 the per-node acceptance has a closed form, α(lam) = Σ c + Σ min(R, kappa) + Σ_x M[x, x]. lam is
chosen per node (and per step) by maximising that two-step value on a small grid that includes lam = 0 (rsd's
first step, with a better residual) and lam = inf (accept nothing at the first draw). The search looks only at
the LAMBDA_SEARCH_TOKENS largest tokens of p + q: any lam is exact, so this costs acceptance, never exactness.
For n > 2 the same two-step criterion is used at every step (myopic); acceptance there has no closed form
(Monte Carlo, like rsd and gumbel). Verification works in float64: exactness rests on the margin identities.
"""

from __future__ import annotations

import torch

from resispec.verify.base import (
    Proposal,
    Tensor,
    check_draws,
    check_pair,
    draw_distinct,
    first_slot,
    sample_weights,
    uniform,
)

# lam = 0 (rsd's first step) is always a candidate; lam >= max p/q accepts nothing at this draw
LAMBDA_GRID = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 1e30], dtype=torch.float64)
_TINY = 1e-300
LAMBDA_SEARCH_TOKENS = 256  # the lam search looks at this many tokens (largest p + q) per row


def _transport(p: Tensor, q: Tensor, lam: Tensor):
    """Step quantities for target residual p, draw distribution q (both [B, V]) and lam [B, 1] (docstring).
    Without autograd it works in place where it can: at V = 32k every [B, V] temporary is a large allocation."""
    if p.requires_grad or q.requires_grad:
        c = torch.minimum((p - lam * q).clamp(min=0.0), q)
    else:
        c = torch.addcmul(p, lam, q, value=-1.0).clamp_(min=0.0)
        c = torch.minimum(c, q, out=c)
    big_r = p - c  # [B, V] target mass left (column sums of M); c <= p
    r = q - c  # [B, V] rejection mass per drawn token (row sums of M); c <= q
    s = r / (1.0 - q).clamp(min=1e-12)  # [B, V]
    den = (s.sum(-1, keepdim=True) - s).clamp(min=_TINY)  # [B, V]; kappa = q * den: column sums of K
    kappa = q * den
    q_rho = torch.minimum(q, big_r / den)  # q * min(1, R / kappa): the columns of K cut down to fit R
    d = (r - s * (q_rho.sum(-1, keepdim=True) - q_rho)).clamp(min=0.0)  # [B, V] row deficits
    e = (big_r - kappa).clamp(min=0.0)  # [B, V] column deficits (Σ d = Σ e)
    diag = torch.minimum(d, e)  # [B, V] deficit routed back onto the rejected token itself
    return c, big_r, r, s, kappa, q_rho, diag, d - diag, e - diag


def two_step_value(p: Tensor, q: Tensor, lam: Tensor) -> Tensor:
    """Per-node α of the two-draw shaped rule: Σ c + Σ min(R, kappa) + Σ M[x, x]. p, q [B, V], lam [B, 1] -> [B]."""
    c, big_r, _, _, kappa, _, diag, d_rest, e_rest = _transport(p, q, lam)
    on_diag = diag + d_rest * e_rest / e_rest.sum(-1, keepdim=True).clamp(min=_TINY)
    return c.sum(-1) + torch.minimum(big_r, kappa).sum(-1) + on_diag.sum(-1)


def choose_lambda(
    p: Tensor, q: Tensor, grid: Tensor = LAMBDA_GRID, top: int = LAMBDA_SEARCH_TOKENS
) -> Tensor:
    """Per-row lam maximising the two-step value on `grid` (ties -> smallest lam). p, q [B, V] -> [B, 1].

    With V > top the search looks only at the `top` tokens of largest p + q (renormalised): lam is then an
    approximate maximiser, which costs a little acceptance and never exactness (any lam is exact). The n = 2
    closed form evaluates the full vocabulary at the lam chosen here, so it stays the rule's exact α."""
    if p.shape[-1] > top:
        idx = (p + q).topk(top, dim=-1).indices  # [B, top]
        p, q = p.gather(-1, idx), q.gather(-1, idx)
        p = p / p.sum(-1, keepdim=True).clamp(min=_TINY)
        q = q / q.sum(-1, keepdim=True).clamp(min=_TINY)
    best_v = torch.full(p.shape[:1], -1.0, dtype=p.dtype, device=p.device)  # [B]
    best_l = torch.zeros(p.shape[:1], dtype=p.dtype, device=p.device)  # [B]
    for lam in grid.tolist():  # a loop, not a [B, G, V] tensor: memory stays O(B V)
        v = two_step_value(p, q, torch.full_like(best_v[:, None], lam))
        better = v > best_v + 1e-12
        best_v = torch.where(better, v, best_v)
        best_l = torch.where(better, torch.full_like(best_l, lam), best_l)
    return best_l[:, None]


def residual_after_reject(p: Tensor, q: Tensor, lam: Tensor, x: Tensor) -> Tensor:
    """Row M[x, :] / r(x): the target residual after the shaped step rejected draw x.
    p, q [B, V], lam [B, 1], x [B] -> [B, V] (rows where x cannot be rejected return p unchanged)."""
    _, _, _, s, _, q_rho, diag, d_rest, e_rest = _transport(p, q, lam)
    xi = x[:, None]  # [B, 1]
    row = (s.gather(-1, xi) * q_rho).scatter(-1, xi, 0.0)  # [B, V] the part that meets the next draw
    row = row.scatter_add(-1, xi, diag.gather(-1, xi))  # the part emitted as x itself at the end
    row = row + d_rest.gather(-1, xi) * e_rest / e_rest.sum(-1, keepdim=True).clamp(min=_TINY)
    total = row.sum(-1, keepdim=True)
    return torch.where(total > 0, row / total.clamp(min=_TINY), p)


class ResiSpecWORRule:
    """Exact sequential verification of n distinct draws with residual shaping (module docstring)."""

    name = "resispec_wor"
    scheme = "distinct"
    closed_form_draws: int | None = 2
    surrogate_draws: int | None = 2
    greedy_only = False

    def propose(self, q: Tensor, n: int, generator: torch.Generator | None = None) -> Proposal:
        tokens = draw_distinct(q, check_draws(n), generator)  # [B, n] (-1 past q's support)
        return Proposal(token_ids=tokens, q=q)

    @torch.no_grad()
    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        """p [B, V] -> token [B], slot [B] (first draw equal to the token, -1 if none)."""
        check_pair(p, proposal.q)
        draws = proposal.token_ids  # [B, n]
        bsz, n = draws.shape
        token = torch.full((bsz,), -1, dtype=torch.long, device=p.device)
        p64 = p.double()
        u_all = uniform((bsz, n), p64, generator)  # [B, n]
        # rows still undecided; the state below (pc, qc: [R, V]) is kept for them only
        rows = torch.arange(bsz, device=p.device)
        pc = p64 / p64.sum(-1, keepdim=True)  # float64: exactness rests on the margin identities
        qc = proposal.q.double()
        qc = qc / qc.sum(-1, keepdim=True)
        for i in range(n):
            x = draws[rows, i]  # [R]
            xi = x.clamp_min(0)[:, None]  # [R, 1]
            qx = torch.where(x >= 0, qc.gather(-1, xi)[:, 0], torch.zeros_like(pc[:, 0]))
            px = pc.gather(-1, xi)[:, 0]
            left = torch.minimum(torch.full_like(x, n - i), (qc > 0).sum(-1))  # real draws left, incl. this
            real = qx > 0  # an empty slot (past q's support) is no draw
            shaped = real & (left >= 2)
            lam = choose_lambda(pc, qc) if bool(shaped.any()) else torch.zeros_like(pc[:, :1])
            lam = torch.where(shaped[:, None], lam, torch.zeros_like(lam))  # [R, 1]
            safe_qx = torch.where(qx > 0, qx, torch.ones_like(qx))
            a_shaped = (px - lam[:, 0] * qx).clamp(min=0.0).minimum(qx) / safe_qx
            a_greedy = (px / safe_qx).clamp(max=1.0)
            acc = real & (u_all[rows, i] < torch.where(shaped, a_shaped, a_greedy))
            token[rows[acc]] = x[acc]
            keep = ~acc
            rows, pc, qc, x, xi, lam, shaped, real = (
                t[keep] for t in (rows, pc, qc, x, xi, lam, shaped, real)
            )
            if rows.numel() == 0:
                break
            new_p = pc
            if bool(shaped.any()):
                new_p = torch.where(shaped[:, None], residual_after_reject(pc, qc, lam, x.clamp_min(0)), pc)
            greedy = real & ~shaped
            if bool(greedy.any()):  # the last draw (or q's support is down to one token)
                greedy_res = (pc - qc).clamp(min=0.0)
                gsum = greedy_res.sum(-1, keepdim=True)
                greedy_res = torch.where(gsum > 0, greedy_res / gsum.clamp(min=_TINY), pc)
                new_p = torch.where(greedy[:, None], greedy_res, new_p)
            pc = new_p
            if i == n - 1:
                break
            q_next = qc.scatter(-1, xi, 0.0)
            qsum = q_next.sum(-1, keepdim=True)
            q_next = torch.where(qsum > 0, q_next / qsum.clamp(min=_TINY), q_next)
            qc = torch.where(real[:, None], q_next, qc)
        if rows.numel():
            token[rows] = sample_weights(pc.clamp(min=0.0), generator, p64[rows])
        return token, first_slot(draws, token)

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        """Closed form for n <= 2 (module docstring): p, q [B, V] -> [B], differentiable (lam is a constant).
        No closed form for n > 2 (estimate by sampling)."""
        check_pair(p, q)
        if check_draws(n) == 1:
            return torch.minimum(p, q).sum(-1)
        if n != 2:
            raise NotImplementedError(
                "resispec_wor has a closed-form acceptance for n <= 2 only; sample verify()"
            )
        pd, qd = p.double(), q.double()
        with torch.no_grad():
            lam = choose_lambda(pd.detach(), qd.detach())
        alpha = two_step_value(pd, qd, lam)
        single = (q > 0).sum(-1) < 2  # one real draw (q's support is one token): the greedy step alone
        return torch.where(single, torch.minimum(pd, qd).sum(-1), alpha).to(p.dtype)

    def surrogate_acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        """The closed form itself (n <= 2)."""
        return self.acceptance(p, q, n)
