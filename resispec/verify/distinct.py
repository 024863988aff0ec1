"""Rules whose draws are distinct tokens: onehot (top-n of q), rsd (n draws without replacement + recursive
rejection), hub (top n-1 of q + one sampled off that set) and gumbel (Gumbel-top-n, coupled emission).

Deterministic draws (onehot, hub's top set) are the top of q with ties broken toward the lowest index; when q has
fewer positive tokens than slots they include q = 0 tokens (still exact, and they can still be accepted).
SAMPLED draws (rsd, gumbel, hub's sampled one) never include a token with q = 0: past q's support the slots are
-1 (empty). Every rule stays exact either way.
"""

from __future__ import annotations

import torch

from resispec.sampling import sample_rows
from resispec.verify.base import (
    Proposal,
    Tensor,
    check_draws,
    check_pair,
    draw_distinct,
    first_slot,
    gather_at,
    gumbel_noise,
    id_mask,
    sample_weights,
    top_distinct,
    top_set,
    uniform,
)
from resispec.verify.iid import greedy_step


def gumbel_top(
    q: Tensor, n: int, generator: torch.Generator | None, noise: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """n draws without replacement from q [B, V] (Gumbel-top-n, in draw order) -> tokens [B, n], noise [B, V].
    `noise` (broadcastable to q) gives the Gumbel noise instead of drawing it from the generator."""
    noise = gumbel_noise(q, generator) if noise is None else noise.expand_as(q)
    keys = torch.log(q) + noise  # log 0 = -inf: never drawn
    return top_distinct(keys, q > 0, n), noise


def conditional_draw_probs(q: Tensor, tokens: Tensor) -> Tensor:
    """q_i(x_i) = q(x_i) / (1 - sum_{j<i} q(x_j)) of draws without replacement; 0 for empty slots. -> [B, n]"""
    qx = gather_at(q, tokens)  # [B, n]
    before = torch.cumsum(qx, -1) - qx
    rest = (q.sum(-1, keepdim=True) - before).clamp_min(0)
    return torch.where(
        rest > 0, qx / torch.where(rest > 0, rest, torch.ones_like(rest)), torch.zeros_like(qx)
    )


class OneHotRule:
    """EAGLE-2 style: the top-n tokens of q are the children; emit Y ~ p, accepted iff Y is a child."""

    name = "onehot"
    scheme = "deterministic"
    closed_form_draws: int | None = None
    surrogate_draws: int | None = None
    greedy_only = False

    def propose(self, q: Tensor, n: int, generator: torch.Generator | None = None) -> Proposal:
        return Proposal(token_ids=top_set(q, check_draws(n)), q=q)

    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        check_pair(p, proposal.q)
        token = sample_weights(p, generator, p)
        return token, first_slot(proposal.token_ids, token)

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        """p(top-n of q) -> [B]; differentiable in p (the selection is piecewise constant in q)."""
        check_pair(p, q)
        return gather_at(p, top_set(q.detach(), check_draws(n))).sum(-1)

    def surrogate_acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        return self.acceptance(p, q, n)


class RsdRule:
    """Recursive speculative decoding: draws without replacement, draw i checked against q_i (q without the
    earlier draws, renormalised) with the SpecInfer step. A rejected draw keeps no residual mass (it was
    rejected only because m(x) < mu q_i(x)), so nothing is stranded. No closed-form acceptance."""

    name = "rsd"
    scheme = "distinct"
    closed_form_draws: int | None = 0
    surrogate_draws: int | None = 0
    greedy_only = False

    def propose(self, q: Tensor, n: int, generator: torch.Generator | None = None) -> Proposal:
        tokens = draw_distinct(q, check_draws(n), generator)  # the law of Gumbel-top-n; no noise needed
        return Proposal(token_ids=tokens, q=q, draw_probs=conditional_draw_probs(q, tokens))

    @torch.no_grad()
    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        check_pair(p, proposal.q)
        tokens, q = proposal.token_ids, proposal.q  # [B, n], [B, V]
        vocab = q.shape[-1]
        u = uniform(tuple(tokens.shape), p, generator)  # [B, n]
        m, mu = p, p.sum(-1)  # remaining target mass [B, V] and its total [B]
        taken = torch.zeros_like(q, dtype=torch.bool)  # earlier draws [B, V]
        accepted = torch.zeros_like(tokens[:, 0], dtype=torch.bool)
        token = torch.full_like(tokens[:, 0], -1)
        for i in range(tokens.shape[-1]):
            x = tokens[:, i]
            valid = x >= 0
            q_rest = q.masked_fill(taken, 0)
            rest = q_rest.sum(-1, keepdim=True)
            q_i = torch.where(
                rest > 0, q_rest / torch.where(rest > 0, rest, torch.ones_like(rest)), q_rest
            )  # [B, V]
            qx = gather_at(q_i, x[:, None])[:, 0]
            mx = gather_at(m, x[:, None])[:, 0]
            ok = valid & (u[:, i] * mu * qx < mx) & ~accepted  # w.p. min(1, m(x) / (mu q_i(x)))
            token = torch.where(ok, x, token)
            accepted = accepted | ok
            m = greedy_step(m, mu, q_i)
            mu = m.sum(-1)
            taken = taken | id_mask(x[:, None], vocab)
        fallback = sample_weights(m, generator, p)
        token = torch.where(accepted, token, fallback)
        return token, first_slot(tokens, token)

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        raise NotImplementedError("rsd has no closed-form acceptance; estimate it by sampling verify()")

    def surrogate_acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        return self.acceptance(p, q, n)


def hub_split(q: Tensor, top_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Top-set mask [B, V] and q~ = q off the top set, renormalised [B, V] (all 0 when q lives on the top set)."""
    top_mask = id_mask(top_ids, q.shape[-1])
    q_off = q.masked_fill(top_mask, 0)
    z = q_off.sum(-1, keepdim=True)
    q_tilde = torch.where(z > 0, q_off / torch.where(z > 0, z, torch.ones_like(z)), q_off)
    return top_mask, q_tilde


class HubRule:
    """Top n-1 of q (fixed) + one draw from q~. Accept the sampled one w.p. min(1, p / q~); else emit
    Y ~ [p on the top set; (p - q~)+ off it], accepted iff Y is in the top set. alpha = p(top) + sum_off min(p, q~)."""

    name = "hub"
    scheme = "distinct"
    closed_form_draws: int | None = None
    surrogate_draws: int | None = None
    greedy_only = False

    def propose(self, q: Tensor, n: int, generator: torch.Generator | None = None) -> Proposal:
        check_draws(n)
        top = top_set(q, n - 1)  # [B, n - 1]
        _, q_tilde = hub_split(q, top)
        has_off = q_tilde.sum(-1) > 0
        safe = torch.where(has_off[:, None], q_tilde, torch.ones_like(q_tilde))
        sampled = sample_rows(safe, 1, generator)[:, 0]
        sampled = torch.where(has_off, sampled, torch.full_like(sampled, -1))
        return Proposal(token_ids=torch.cat([top, sampled[:, None]], -1), q=q, top_ids=top)

    @torch.no_grad()
    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        check_pair(p, proposal.q)
        top_mask, q_tilde = hub_split(proposal.q, proposal.top_ids)
        x = proposal.token_ids[:, -1]  # the sampled draw (-1: q lives on the top set)
        qx = gather_at(q_tilde, x[:, None])[:, 0]
        px = gather_at(p, x[:, None])[:, 0]
        u = uniform((p.shape[0],), p, generator)
        ok = (x >= 0) & (u * qx < px)  # w.p. min(1, p / q~)
        residual = torch.where(top_mask, p, (p - q_tilde).clamp_min(0))  # [B, V]
        token = torch.where(ok, x, sample_weights(residual, generator, p))
        return token, first_slot(proposal.token_ids, token)

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        check_pair(p, q)
        top = top_set(q.detach(), check_draws(n) - 1)
        top_mask, q_tilde = hub_split(q, top)
        return torch.where(top_mask, p, torch.minimum(p, q_tilde)).sum(-1)

    def surrogate_acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        return self.acceptance(p, q, n)


class GumbelRule:
    """Gumbel-top-n children with noise G; emit Y = argmax(log p + G) with the SAME G (exactly p, by the
    Gumbel-max trick); accepted iff Y is a child. No closed-form acceptance."""

    name = "gumbel"
    scheme = "distinct"
    closed_form_draws: int | None = 0
    surrogate_draws: int | None = 0
    greedy_only = False

    def propose(
        self, q: Tensor, n: int, generator: torch.Generator | None = None, noise: Tensor | None = None
    ) -> Proposal:
        """`noise` [1 or B, V]: draft with this Gumbel noise (a SeedStream's, keyed by position) instead of the
        generator's."""
        tokens, noise = gumbel_top(q, check_draws(n), generator, noise)
        return Proposal(token_ids=tokens, q=q, noise=noise)

    @torch.no_grad()
    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        check_pair(p, proposal.q)
        if proposal.noise is None:
            raise ValueError("gumbel.verify needs the proposal's Gumbel noise (use gumbel.propose)")
        token = (torch.log(p) + proposal.noise).argmax(-1)
        return token, first_slot(proposal.token_ids, token)

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        raise NotImplementedError("gumbel has no closed-form acceptance; estimate it by sampling verify()")

    def surrogate_acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        return self.acceptance(p, q, n)
