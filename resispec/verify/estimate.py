"""Per-node acceptance of any rule on given (p, q): the closed form where the rule has one, else Monte Carlo.

rate, se = monte_carlo_alpha(rule, p, q, n, samples, generator)   # [N], [N]: propose + verify, `samples` runs
alpha = mean_acceptance(rule, p, q, n, samples, generator)      # float: closed form where a row has one, else MC
per_node_alpha(p, q, n, ["resispec", "gumbel"], samples, generator)  # {rule: {"alpha", "se", "method"}} + bounds
"""

from __future__ import annotations

import torch

from resispec.verify.base import Tensor, covers
from resispec.verify.bounds import optimal_acceptance, wor_prefix_bound
from resispec.verify.registry import VERIFIERS


def monte_carlo_alpha(
    rule, p: Tensor, q: Tensor, n: int, samples: int, generator: torch.Generator, chunk_rows: int = 1 << 21
) -> tuple[Tensor, Tensor]:
    """Per-node acceptance rate of rule.propose + rule.verify, and its standard error. p, q [N, V] -> [N], [N]."""
    nodes_per_chunk = max(1, chunk_rows // (samples * p.shape[-1]))
    rates = []
    for start in range(0, p.shape[0], nodes_per_chunk):
        pp = p[start : start + nodes_per_chunk].repeat_interleave(samples, 0)
        qq = q[start : start + nodes_per_chunk].repeat_interleave(samples, 0)
        _, slot = rule.verify(pp, rule.propose(qq, n, generator), generator)
        rates.append((slot >= 0).double().view(-1, samples).mean(-1))
    rate = torch.cat(rates)
    return rate, (rate * (1 - rate) / samples).sqrt()


def mean_acceptance(rule, p: Tensor, q: Tensor, n: int, samples: int, generator: torch.Generator) -> float:
    """Mean per-node acceptance of `rule` at n draws over the nodes p, q [N, V]: the closed form on every row that
    has one, Monte Carlo (monte_carlo_alpha, `samples` runs a node) on the others only. Every row has one where the
    rule covers n (closed_form_draws); a rule that picks its scheme per row (resispec_auto) names its closed-form
    rows in `closed_form_rows(q, n)`. Exact rows cost nothing and add no sampling noise."""
    pd, qd = p.double(), q.double()
    if covers(rule.closed_form_draws, n):
        return float(rule.acceptance(pd, qd, n).mean())
    named = getattr(rule, "closed_form_rows", None)
    exact = named(qd, n) if named is not None else torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
    alpha = torch.zeros(q.shape[0], dtype=torch.float64, device=q.device)
    if bool(exact.any()):
        alpha[exact] = rule.acceptance(pd[exact], qd[exact], n)
    if not bool(exact.all()):
        alpha[~exact] = monte_carlo_alpha(rule, p[~exact], q[~exact], n, samples, generator)[0]
    return float(alpha.mean())


def per_node_alpha(
    p: Tensor,
    q: Tensor,
    n: int,
    rules: list[str],
    samples: int,
    generator: torch.Generator,
    bounds: bool = True,
) -> dict[str, dict]:
    """{rule: {"alpha": [N], "se": [N], "method": "closed form" | "monte carlo"}} plus the two bounds."""
    out: dict[str, dict] = {}
    for name in rules:
        rule = VERIFIERS[name]
        if covers(rule.closed_form_draws, n):
            alpha = rule.acceptance(p, q, n).double()
            out[name] = {"alpha": alpha, "se": torch.zeros_like(alpha), "method": "closed form"}
        else:
            alpha, se = monte_carlo_alpha(rule, p, q, n, samples, generator)
            out[name] = {"alpha": alpha, "se": se, "method": "monte carlo"}
    if not bounds:
        return out
    iid = optimal_acceptance(p, q, n, scheme="iid").double()
    out["alpha*_iid"] = {"alpha": iid, "se": torch.zeros_like(iid), "method": "exact bound"}
    wor = wor_prefix_bound(p, q, n)
    out["alpha*_wor"] = {
        "alpha": wor,
        "se": torch.zeros_like(wor),
        "method": "prefix bound (exact on enumerated cases)" if n == 2 else "prefix bound (upper)",
    }
    return out
