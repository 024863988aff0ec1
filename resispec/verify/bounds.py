"""Upper bounds on per-node acceptance over ALL exact rules for a drafting scheme (docs/design.md).

alpha*_iid = min over prefixes H of the tokens sorted by increasing p/q of [p(H) + 1 - q(H)^n]  (O(V log V));
alpha*_wor = min over all sets H of [p(H) + 1 - P(all n distinct draws lie in H)]            (2^V: small V only);
  `wor_prefix_bound` restricts H to the p/q-sorted prefixes: an upper bound on alpha*_wor for any V.
(Any rule emits a token outside H with probability >= p(V \\ H); it can only emit a child there, so it fails
whenever all draws lie in H and the token does not.)
"""

from __future__ import annotations

import itertools

import torch

from resispec.verify.base import Tensor, check_draws, check_pair

MAX_WOR_VOCAB = 12  # 2^V sets x P(V, n) ordered draws


def optimal_iid(p: Tensor, q: Tensor, n: int) -> Tensor:
    """alpha*_iid [B] for n i.i.d. draws. p, q [B, V]."""
    w = torch.where(q > 0, p / torch.where(q > 0, q, torch.ones_like(q)), torch.full_like(p, float("inf")))
    order = torch.argsort(w, dim=-1)
    acc = torch.float64 if p.dtype == torch.float64 or p.device.type == "cpu" else p.dtype
    p_h = torch.cumsum(p.gather(-1, order).to(acc), -1)  # [B, V] p(H) over prefixes
    q_h = torch.cumsum(q.gather(-1, order).to(acc), -1).clamp(0, 1)
    total = p.sum(-1).to(acc)  # 1 up to rounding; the empty prefix gives `total`
    vals = p_h + total[:, None] - q_h**n
    return torch.minimum(vals.min(-1).values, total).to(p.dtype)


def _wor_all_in(q: Tensor, n: int) -> Tensor:
    """P(all draws in H) for every set H (bitmask index) [B, 2^V]. Draws without replacement from q stop at its
    support, so a row with k < n tokens of positive mass draws exactly k."""
    bsz, vocab = q.shape
    q = q.to(torch.float64)
    support = (q > 0).sum(-1)  # [B]
    num_sets = 1 << vocab
    sets = torch.arange(num_sets, device=q.device)
    bits = ((sets[:, None] >> torch.arange(vocab, device=q.device)) & 1).bool()  # [2^V, V]
    out = torch.zeros(bsz, num_sets, dtype=torch.float64, device=q.device)
    for length in range(1, n + 1):
        use = (
            torch.minimum(support, torch.tensor(n, device=q.device)) == length
        )  # rows drawing `length` tokens
        if not bool(use.any()):
            continue
        seqs = torch.tensor(
            list(itertools.permutations(range(vocab), length)), device=q.device
        )  # [S, length]
        qs = q[:, seqs]  # [B, S, length]
        before = torch.cumsum(qs, -1) - qs
        rest = (q.sum(-1)[:, None, None] - before).clamp_min(0)
        prob = torch.where(
            rest > 0, qs / torch.where(rest > 0, rest, torch.ones_like(rest)), torch.zeros_like(qs)
        )
        seq_prob = prob.prod(-1)  # [B, S]
        inside = bits[:, seqs].all(-1).to(torch.float64)  # [2^V, S]: the sequence lies in the set
        out = torch.where(use[:, None], seq_prob @ inside.T, out)
    return out


def optimal_wor(p: Tensor, q: Tensor, n: int) -> Tensor:
    """alpha*_wor [B] for n draws without replacement, by enumeration of all 2^V sets (V <= MAX_WOR_VOCAB)."""
    vocab = p.shape[-1]
    if vocab > MAX_WOR_VOCAB:
        raise ValueError(f"optimal_acceptance(scheme='wor') enumerates 2^V sets; V={vocab} > {MAX_WOR_VOCAB}")
    sets = torch.arange(1 << vocab, device=p.device)
    bits = ((sets[:, None] >> torch.arange(vocab, device=p.device)) & 1).to(torch.float64)  # [2^V, V]
    p_h = p.to(torch.float64) @ bits.T  # [B, 2^V]
    vals = p_h + p.to(torch.float64).sum(-1, keepdim=True) - _wor_all_in(q, n)
    return vals.min(-1).values.to(p.dtype)


def optimal_acceptance(p: Tensor, q: Tensor, n: int, scheme: str = "iid") -> Tensor:
    """Upper bound on per-node acceptance [B] of any exact rule: scheme "iid" (alpha*_iid, any V) or "wor"
    (alpha*_wor, exact enumeration, V <= 12). p, q [B, V]."""
    check_pair(p, q)
    check_draws(n)
    with torch.no_grad():
        if scheme == "iid":
            return optimal_iid(p, q, n)
        if scheme == "wor":
            return optimal_wor(p, q, n)
    raise ValueError(f"unknown scheme {scheme!r}; choose 'iid' or 'wor'")


def wor_prefix_bound(p: Tensor, q: Tensor, n: int, grid_size: int = 400) -> Tensor:
    """Upper bound on α*_wor [N]: min over prefixes H of the tokens sorted by increasing p/q of
    p(H) + 1 - P(all n distinct draws lie in H). n = 2: P = q(H) Σ_H q/(1-q) - Σ_H q²/(1-q) exactly.
    n > 2: P by exponential races (draws without replacement = order of arrival of clocks with rates q),
        P(S ⊆ H) = ∫ P(at least n of H arrived by u) d(1 - exp(-q(H^c) u)),
    bracketed from below on a log grid of u (the integrand increases in u), so the result stays an upper bound."""
    w = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(p, float("inf")))
    order = torch.argsort(w, dim=-1)
    p_s, q_s = p.gather(-1, order).double(), q.gather(-1, order).double()  # [N, V]
    p_h = torch.cumsum(p_s, -1)  # [N, V] p(H_k), k = 1..V
    if n == 2:
        q_h = torch.cumsum(q_s, -1)
        a = torch.cumsum(q_s / (1 - q_s).clamp_min(1e-300), -1)
        b = torch.cumsum(q_s**2 / (1 - q_s).clamp_min(1e-300), -1)
        inside = (q_h * a - b).clamp(0, 1)
    else:
        u = torch.logspace(-3, 7, grid_size, dtype=torch.float64)  # [G]
        # P(count = j), j = n means >= n
        state = torch.zeros(p.shape[0], grid_size, n + 1, dtype=torch.float64)
        state[..., 0] = 1.0
        q_out = (1 - torch.cumsum(q_s, -1)).clamp_min(0)  # [N, V] q(H^c)
        inside = torch.ones_like(p_s)  # [N, V]; H = support (q(H^c) = 0): always inside
        for k in range(p.shape[1]):
            arrived = -torch.expm1(-q_s[:, k, None] * u)  # [N, G]
            moved = state[..., :n] * arrived[..., None]  # [N, G, n]
            state = state.clone()
            state[..., :n] -= moved
            state[..., 1:] += moved
            cdf = -torch.expm1(-q_out[:, k, None] * u)  # [N, G] law of the first arrival outside H
            step = torch.diff(cdf, dim=-1, append=torch.ones_like(cdf[:, :1]))  # mass of [u_g, u_{g+1})
            lower = (state[..., n] * step).sum(-1).clamp(0, 1)  # left end: the integrand increases in u
            inside[:, k] = torch.where(q_out[:, k] > 0, lower, inside[:, k])
    vals = p_h + 1 - inside
    return torch.minimum(vals.min(-1).values, torch.ones_like(vals[:, 0]))
