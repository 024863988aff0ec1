"""The i.i.d. sequential rules: chain, rrs (SpecInfer), kseq (SpecTr K-SEQ) and resispec (docs/design.md,
which the function docstrings below cite as DESIGN.md).

All four are instances of ONE sequential scheme (docs/design.md "The ResiSpec rule for i.i.d. draws"). Write
everything per unit of q: with w = p/q, draw i accepts x with probability c_i(w(x)) / mu_i, where
- m_i = p - q * L_i(w) is the remaining target mass, L_i = sum_{j<i} c_j, and mu_i = sum m_i,
- the plan keeps 0 <= c_i <= mu_i and L_i + c_i <= w (so c_i q <= m_i),
- the LAST draw is always greedy, c_n = min(mu_n, w - L_n), and if it rejects too the token is sampled from
  m_{n+1} = (m_n - mu_n q)+ (unnormalised).
By telescoping the emitted token is distributed exactly as p, whatever the plan, and acceptance = 1 - mu_{n+1}.
A plan is therefore only a choice of caps; a badly solved T* or rho* costs acceptance, never exactness.

Plans (c_i for the draws before the last):
- greedy (rrs, chain): stacked windows from the bottom, c_i = |[M_i, M_i + mu_i] cap [0, w]|, M_i = sum_{j<i} mu_j.
  Then m_{i+1} = (m_i - mu_i q)+, the SpecInfer residual.
- shaped (resispec): the same windows stacked DOWN from T ("late filling"): S_1 = T,
  S_{i+1} = max(S_i - mu_i, 0), c_i = |[S_{i+1}, S_i] cap [0, min(w, T)]|. The windows are disjoint and have
  width <= mu_i, so the two cap conditions hold for ANY T (the run-time guard of docs/design.md, by construction).
  At T = T* they are docs/design.md's c_i, S_{n+1} = 0, and acceptance = sum min(p, T* q).
- scaled (kseq): c_i = nu_i min(1, w / rho) with nu_i = min(mu_i, rho - sum_{j<i} nu_j)+ (nu_i = mu_i at rho*),
  i.e. accept with probability min(1, p / (rho q)) as in SpecTr; acceptance = sum min(p, rho* q).
Only the caps at the DRAWN tokens ([B, n] gathers) and mu_i ([B], from the ratio profile or one O(V) sum) are
needed per draw; the full [B, V] residual is built once, for the rejection sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from resispec.verify.base import (
    Proposal,
    Tensor,
    check_draws,
    check_pair,
    draw_iid,
    first_slot,
    sample_rejected,
    uniform,
)
from resispec.verify.ratio import (
    HistogramProfile,
    HostHistogramProfile,
    HostRatioProfile,
    RatioProfile,
    build_profile,
    direct_mass,
    histogram_profile,
    on_host,
)


def bisection_steps(dtype: torch.dtype) -> int:
    """Halvings of [1, n] for T* / rho*: to ~(n - 1) 2^-44 in float64, ~(n - 1) 2^-26 otherwise (float32 noise).
    d alpha / dT <= 1, so this is also the error in alpha; exactness never depends on it."""
    return 44 if dtype == torch.float64 else 26


# ---------------------------------------------------------------------------------------------- shared formulas


def capped_mass(p: Tensor, q: Tensor, t: Tensor) -> Tensor:
    """sum_x min(p, t q) per row: the closed-form acceptance of kseq (t = rho*) and resispec (t = T*).
    p, q [B, V], t [B] (a constant for autograd) -> [B]. Differentiable in p and q, no division."""
    return torch.minimum(p, t[:, None] * q).sum(-1)


def greedy_step(m: Tensor, mu: Tensor, q: Tensor) -> Tensor:
    """The SpecInfer/rsd residual update m_{i+1} = (m_i - mu_i q)+ (unnormalised). m, q [B, V], mu [B] -> [B, V].
    Accepting x with probability min(1, m(x) / (mu q(x))) takes min(m, mu q) of the mass."""
    return (m - mu[:, None] * q).clamp_min(0)


def greedy_masses(p: Tensor, q: Tensor, n: int) -> Tensor:
    """mu_1..mu_{n+1} [B, n + 1] of n greedy (rrs) draws from q: mu_{i+1} = sum (m_i - mu_i q)+.
    Differentiable; rrs acceptance is mu_1 - mu_{n+1} = 1 - prod(1 - beta_i)."""
    m = p
    mus = [p.sum(-1)]
    for _ in range(n):
        m = greedy_step(m, mus[-1], q)
        mus.append(m.sum(-1))
    return torch.stack(mus, -1)


# ---------------------------------------------------------------------------------------------- solvers


# The solvers and the shaped plan run on a profile's own arrays: torch tensors (RatioProfile, HistogramProfile,
# DirectMass) or, for the decoder's one-node calls on CPU, numpy (HostRatioProfile, HostHistogramProfile,
# HostDirectMass): the same code, written with the operators and methods both share, and `_xp` for the few
# functions that differ by module.
Profile = RatioProfile | HostRatioProfile | HistogramProfile | HostHistogramProfile


def _xp(x):
    """The array module of x: numpy or torch (for where and stack)."""
    return np if isinstance(x, np.ndarray) else torch


def _in_profile(t: Tensor, profile) -> Tensor | np.ndarray:
    """A torch [B] value in the profile's array type and accumulator dtype."""
    if isinstance(profile.total, np.ndarray):
        return t.detach().to("cpu", torch.float64).numpy()
    return t.to(profile.total.dtype)


def _to_torch(x, like: Tensor) -> Tensor:
    """A profile-side array back as a torch tensor in like's dtype."""
    return (torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x).to(like.dtype)


def _window_mass(profile: Profile, lo, hi):
    """F(hi) - F(lo) for lo, hi [B, K]: one profile lookup with the pair side by side on torch, two on numpy."""
    if isinstance(lo, np.ndarray):
        return profile.capped_mass(hi) - profile.capped_mass(lo)
    num = lo.shape[-1]
    f = profile.capped_mass(torch.cat([hi, lo], -1))  # [B, 2K]
    return f[:, :num] - f[:, num:]


def _resispec_g(profile: Profile, total, t, n: int):
    """DESIGN.md's g(T) = T - sum_i mu_i for the late-filling plan, batched: t [B] or [B, K] -> same shape."""
    squeeze = t.ndim == 1
    t = t[:, None] if squeeze else t  # [B, K]
    mu, s = t * 0 + total[:, None], t
    for _ in range(n):
        s_next = s - mu
        lo = s_next.clip(0)  # planned sum of the caps still to come
        hi = (lo + mu).clip(max=t)
        mu = mu - _xp(t).where(lo < t, _window_mass(profile, lo, hi), 0.0)
        s = s_next
    return s[:, 0] if squeeze else s


# points per round of the grid search for T*: 2^k - 1 points narrow the bracket by 2^k (k bisection steps) in one
# vectorised pass. Small batches (the decoder: one node) take 127 points, ~7x fewer passes (torch calls, the cost at
# B = 1) than bisection; huge batches, where the [B, K] work itself is the cost, fall back toward plain bisection.
_GRID_POINTS = (127, 63, 31, 15, 7, 3, 1)
_GRID_BUDGET = 1 << 16  # B x K elements per evaluation


def _grid_points(batch: int) -> int:
    return next((k for k in _GRID_POINTS if batch * k <= _GRID_BUDGET), 1)


@torch.no_grad()
def solve_resispec_T(
    p: Tensor, q: Tensor, n: int, profile: Profile | None = None, steps: int | None = None
) -> Tensor:
    """T* in [1, n] with g(T*) = 0 (the smallest root), by a grid search on the ratio profile: each round
    evaluates g at 2^k - 1 points of the bracket in one pass (O(n log V) per point; k = 7 for small batches) and
    keeps the cell where g changes sign, i.e. k bisection steps at once. `steps` counts bisection-equivalent halvings. p, q [B, V] -> [B].
    Returns the upper end of the final bracket (g >= 0), in p's dtype. Any profile of iid.py's `Profile`; the
    default is `build_profile(p, q)` (numpy for one row on CPU). On a HostHistogramProfile (one row, what verify()
    builds there) the same bracket comes from bisection on Python floats (`_bisect`)."""
    check_pair(p, q)
    check_draws(n)
    profile = profile or build_profile(p, q)
    total = profile.total  # sum p (1 up to rounding)
    num_steps = (bisection_steps(p.dtype) if steps is None else steps) if n > 1 else 0
    if isinstance(profile, HostHistogramProfile):  # one row: bisection on Python floats (_bisect)
        f, mass = profile.scalar_capped_mass(), float(total[0])
        t = _bisect(lambda t: _resispec_g_scalar(f, mass, t, n) < 0, n, num_steps)
        return torch.tensor([t], dtype=p.dtype)
    lo, hi = total * 0 + 1, total * 0 + n
    per_round = (_grid_points(total.shape[0]) + 1).bit_length() - 1  # halvings per round
    # exactly num_steps halvings whatever the batch size (the last round takes the halvings left), so a row's T,
    # hence its plan and its output for given uniforms, never depends on how many rows share the call
    left = num_steps
    while left > 0:
        halvings = min(per_round, left)
        points = (1 << halvings) - 1
        ticks = torch.arange(1, points + 1, dtype=torch.float64)  # [K]
        ticks = ticks.numpy() if isinstance(total, np.ndarray) else ticks.to(total)
        step = (hi - lo) / (points + 1)
        grid = lo[:, None] + step[:, None] * ticks  # [B, K] increasing; grid point j is lo + step * (j + 1)
        # g is nondecreasing in T: the first num_neg grid points have g < 0, the rest g >= 0
        num_neg = (_resispec_g(profile, total, grid, n) < 0).sum(-1)  # [B]
        lo, hi = lo + step * num_neg, lo + step * (num_neg + 1)
        left -= halvings
    return _to_torch(hi, p)


def _resispec_g_scalar(f: Callable[[float], float], total: float, t: float, n: int) -> float:
    """_resispec_g at one T on Python floats, f: the profile's scalar F (scalar_capped_mass)."""
    mu, s = total, t
    for _ in range(n):
        s_next = s - mu
        lo = max(s_next, 0.0)
        if lo < t:
            mu -= f(min(lo + mu, t)) - f(lo)
        s = s_next
    return s


def _bisect(below: Callable[[float], bool], n: int, steps: int) -> float:
    """`steps` halvings of [1, n] keeping the root inside (below(x): the root is above x) -> the upper end. The
    one-row solvers' search: with the scalar F a step costs ~3 us, where a numpy call costs ~2 us and a grid round
    (solve_resispec_T) ~40 of them; the same bracket as the grid's (2^k - 1 points = k halvings)."""
    lo, hi = 1.0, float(n)
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        if below(mid):
            lo = mid
        else:
            hi = mid
    return hi


def _kseq_h(profile: Profile, total, rho, n: int):
    """SpecTr's condition: h(rho) = (1 - (1 - beta)^n) - F(rho) with beta = F(rho) / rho; zero at rho*."""
    f = profile.capped_mass(rho)
    beta = (f / rho).clip(0, 1)
    return total * (1 - (1 - beta) ** n) - f


@torch.no_grad()
def solve_kseq_rho(
    p: Tensor, q: Tensor, n: int, profile: Profile | None = None, steps: int | None = None
) -> Tensor:
    """rho* in [1, n] of SpecTr K-SEQ (h(1) >= 0 >= h(n)), by bisection on the ratio profile. p, q [B, V] -> [B]."""
    check_pair(p, q)
    check_draws(n)
    profile = profile or build_profile(p, q)
    total = profile.total
    num_steps = (bisection_steps(p.dtype) if steps is None else steps) if n > 1 else 0
    if isinstance(profile, HostHistogramProfile):  # one row: bisection on Python floats

        def below_root(rho: float, f=profile.scalar_capped_mass(), mass=float(total[0])) -> bool:
            f_rho = f(rho)
            beta = min(max(f_rho / rho, 0.0), 1.0)
            return mass * (1 - (1 - beta) ** n) - f_rho > 0  # _kseq_h > 0

        return torch.tensor([_bisect(below_root, n, num_steps)], dtype=p.dtype)
    lo, hi = total * 0 + 1, total * 0 + n
    where = _xp(total).where
    for _ in range(num_steps):
        mid = 0.5 * (lo + hi)
        pos = _kseq_h(profile, total, mid, n) > 0
        lo, hi = where(pos, mid, lo), where(pos, hi, mid)
    return _to_torch(hi, p)


# ---------------------------------------------------------------------------------------------- plans


@dataclass
class WindowPlan:
    """Caps c_i(w) = |[lo_i, hi_i] cap [0, w]| for the first n - 1 draws; windows disjoint, inside [bottom, top].

    mu: [B, n] remaining mass before each draw. lo, hi: [B, n - 1]. bottom, top: [B]."""

    mu: Tensor
    lo: Tensor
    hi: Tensor
    bottom: Tensor
    top: Tensor

    # the methods take torch tensors or numpy arrays alike (verify_sequential's one-row path, `host_plan`)
    def caps(self, w: Tensor) -> Tensor:
        """c_1..c_{n-1}, each at its draw's ratio: w [B, n - 1] -> [B, n - 1]."""
        return (_xp(w).minimum(w, self.hi) - self.lo).clip(min=0)

    def used(self, w: Tensor) -> Tensor:
        """L_n(w) = sum of the caps before the last draw, at w [B] -> [B]."""
        return (_xp(w).minimum(w, self.top) - self.bottom).clip(min=0)

    def used_mass(self, p: Tensor, q: Tensor) -> Tensor:
        """q * L_n(w) over the vocabulary, [B, V] (no division by q)."""
        return (_xp(p).minimum(p, self.top[:, None] * q) - self.bottom[:, None] * q).clip(min=0)


@dataclass
class ScaledPlan:
    """kseq caps c_i(w) = nu_i min(1, w / rho). mu: [B, n], nu: [B, n - 1], rho: [B]."""

    mu: Tensor
    nu: Tensor
    rho: Tensor

    def caps(self, w: Tensor) -> Tensor:
        return self.nu * (w / self.rho[:, None]).clip(max=1)

    def used(self, w: Tensor) -> Tensor:
        return self.nu.sum(-1) * (w / self.rho).clip(max=1)

    def used_mass(self, p: Tensor, q: Tensor) -> Tensor:
        return (self.nu.sum(-1) / self.rho)[:, None] * _xp(p).minimum(p, self.rho[:, None] * q)


def host_plan(plan: WindowPlan | ScaledPlan) -> WindowPlan | ScaledPlan:
    """The plan with its CPU tensors as numpy arrays (shared memory, no copy)."""
    return replace(plan, **{f.name: getattr(plan, f.name).numpy() for f in fields(plan)})


def greedy_plan(p: Tensor, q: Tensor, n: int) -> WindowPlan:
    """rrs: windows [M_i, M_i + mu_i] from the bottom; mu from the same recursion as rrs's acceptance."""
    mu = greedy_masses(p, q, n)[:, :n]  # [B, n]
    levels = torch.cumsum(mu, -1)  # M_{i+1}
    zero = torch.zeros_like(mu[:, :1])
    lo = torch.cat([zero, levels[:, :-1]], -1)[:, : n - 1]
    return WindowPlan(
        mu=mu, lo=lo, hi=levels[:, : n - 1], bottom=zero[:, 0], top=levels[:, n - 2] if n > 1 else zero[:, 0]
    )


def shaped_plan(p: Tensor, q: Tensor, n: int, t: Tensor, profile) -> WindowPlan:
    """resispec: late-filling windows stacked down from T, with the ACTUAL mu_i (from the profile: any of
    `Profile` or DirectMass)."""
    t = _in_profile(t, profile)
    total = profile.total
    f_top = profile.capped_mass(t)
    mus, los, his = [total], [], []
    s = t
    for _ in range(n - 1):
        s_next = (s - mus[-1]).clip(0)
        los.append(s_next)
        his.append(s)
        mus.append(total - (f_top - profile.capped_mass(s_next)))
        s = s_next
    xp = _xp(total)
    stack = lambda xs: _to_torch(xp.stack(xs, -1), p) if xs else torch.zeros_like(p[:, :0])  # noqa: E731
    return WindowPlan(
        mu=stack(mus), lo=stack(los), hi=stack(his), bottom=_to_torch(s, p), top=_to_torch(t, p)
    )


def scaled_plan(p: Tensor, q: Tensor, n: int, rho: Tensor) -> ScaledPlan:
    """kseq: nu_i = min(mu_i, rho - sum_{j<i} nu_j)+, mu_{i+1} = mu_i - nu_i beta, beta = F(rho) / rho."""
    total = p.sum(-1)
    beta = capped_mass(p, q, rho) / rho
    mus, nus = [total], []
    used = torch.zeros_like(total)
    for _ in range(n - 1):
        nu = torch.minimum(mus[-1], rho - used).clamp_min(0)
        nus.append(nu)
        used = used + nu
        mus.append(mus[-1] - nu * beta)
    nu_t = torch.stack(nus, -1) if nus else torch.zeros_like(p[:, :0])
    return ScaledPlan(mu=torch.stack(mus, -1), nu=nu_t, rho=rho)


def _take(x, ids):
    """x[b, ids[b, j]] for torch tensors or numpy arrays: [B, V], [B, k] -> [B, k]."""
    return np.take_along_axis(x, ids, -1) if isinstance(x, np.ndarray) else x.gather(-1, ids)


def _accept_tests(p, tokens, q, u, plan):
    """The tests of verify_sequential, on torch tensors or numpy arrays alike (the same elementwise float ops, so
    the same bits): p, q [B, V], tokens [B, n], u [B, n] -> (accepted [B]: some draw accepted, first [B, 1]: the
    first draw that accepted, residual() -> m_{n+1} [B, V])."""
    xp = _xp(p)
    n = tokens.shape[-1]
    valid = tokens >= 0
    ids = tokens.clip(min=0)
    px, qx = _take(p, ids), _take(q, ids)  # [B, n]
    w = xp.where(qx > 0, px / xp.where(qx > 0, qx, xp.ones_like(qx)), xp.zeros_like(qx))
    mu = plan.mu  # [B, n]
    last = n - 1
    # every draw's cap at once: the plan's for draws 1..n-1; the greedy last draw takes all that is left of x, up
    # to mu_n. Draw i accepts when u_i mu_i < c_i; the first draw that accepts is the emitted one.
    tail = xp.minimum(mu[:, last], w[:, last] - plan.used(w[:, last]))
    c = xp.concatenate([plan.caps(w[:, :last]), tail[:, None]], -1)  # [B, n]
    ok = valid & (u * mu < c)  # [B, n]
    # the first True: argmax returns the first maximum (torch's needs numbers)
    first = ok.argmax(-1)[:, None] if xp is np else ok.to(torch.uint8).argmax(-1, keepdim=True)

    def residual():
        return (p - plan.used_mass(p, q) - mu[:, last, None] * q).clip(min=0)

    return ok.any(-1), first, residual


@torch.no_grad()
def verify_sequential(
    p: Tensor, proposal: Proposal, plan, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Run a plan on the draws (module docstring). p [B, V] -> token [B], slot [B].
    One row on CPU (the decoder's nodes) runs the tests on numpy: the same ops and bits in ~30 calls that cost
    a fraction of torch's few microseconds each; the uniforms, and the rejection sample, stay torch's."""
    tokens, q = proposal.token_ids, proposal.q  # [B, n], [B, V]
    u = uniform(tuple(tokens.shape), p, generator)  # [B, n]
    if on_host(p):
        arrays = (x.detach().numpy() for x in (p, tokens, q, u))
        ok, first, residual = _accept_tests(*arrays, host_plan(plan))
        fallback = sample_rejected(torch.from_numpy(ok), lambda: torch.from_numpy(residual()), generator, p)
        tokens_row = tokens[0].tolist()
        token = tokens_row[int(first[0, 0])] if ok[0] else int(fallback[0])
        slot = tokens_row.index(token) if token in tokens_row else -1
        return torch.tensor([token]), torch.tensor([slot])
    accepted, first, residual = _accept_tests(p, tokens, q, u, plan)
    fallback = sample_rejected(accepted, residual, generator, p)
    token = torch.where(accepted, tokens.gather(-1, first)[:, 0], fallback)
    return token, first_slot(tokens, token)


@torch.no_grad()
def verify_one_draw(
    p: Tensor,
    proposal: Proposal,
    generator: torch.Generator | None,
    uniforms: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The sequential scheme at ONE draw per row, what every i.i.d. rule's verification is at n = 1 (standard
    speculative sampling): accept the draw x with probability min(1, w / mu_1), w = p(x) / q(x) and mu_1 = sum p,
    else sample m_2 = (p - mu_1 q)+. The same law as verify_sequential with greedy_plan(p, q, 1), in a third of its
    torch calls (~12 instead of ~40; on CPU the calls are the cost of one node: 0.22-0.39 against 0.45-0.50 ms at
    V = 8192 on the 2-core machine).
    A -1 slot (no draw) accepts nothing and samples p. p [B, V], proposal.token_ids [B, 1] -> token [B], slot [B].
    uniforms: (the acceptance test's [B, 1], the residual draw's [B, 1]), drawn by the caller in that order (a batch
    of rows that each verify with their own generator: sampling.row_uniforms); default drawn here."""
    draws = proposal.token_ids[:, 0]  # [B]
    q = proposal.q
    valid = draws >= 0
    ids = draws.clamp_min(0)[:, None]  # [B, 1]
    total = p.sum(-1, keepdim=True)  # mu_1 [B, 1]
    mu_q = torch.where(valid[:, None], total, torch.zeros_like(total))  # mu_1, or 0 where nothing was drawn
    u_accept, u_residual = uniforms or (uniform((p.shape[0], 1), p, generator), None)
    # u mu_1 < min(mu_1, w)  <=>  u mu_1 q(x) < p(x) (u < 1; a drawn x has q(x) > 0)
    ok = valid & (u_accept * mu_q * q.gather(-1, ids) < p.gather(-1, ids))[:, 0]
    fallback = sample_rejected(ok, lambda: (p - mu_q * q).clamp_min(0), generator, p, u_residual)
    token = torch.where(ok, draws, fallback)
    return token, torch.where(valid & (token == draws), 0, -1)


# ---------------------------------------------------------------------------------------------- rules


class _IidRule:
    scheme = "iid"
    name = ""
    closed_form_draws: int | None = None
    surrogate_draws: int | None = None
    greedy_only = False
    # at ONE draw per node the rule is standard speculative sampling: propose = draw_iid(q, 1) (one uniform per
    # node), verify = verify_one_draw. The batched decoder verifies such chains for all rows at once
    # (resispec.decoding.lean.walk_one_draw_chains)
    one_draw_is_standard = True

    def propose(self, q: Tensor, n: int, generator: torch.Generator | None = None) -> Proposal:
        """n i.i.d. draws from q [B, V] -> Proposal(token_ids [B, n])."""
        check_draws(n)
        return Proposal(token_ids=draw_iid(q, n, generator), q=q)

    def __repr__(self) -> str:
        return f"<verification rule {self.name!r} ({self.scheme})>"

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        raise NotImplementedError

    def surrogate_acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        """The closed form itself."""
        return self.acceptance(p, q, n)


class ChainRule(_IidRule):
    """One sampled draft (standard speculative sampling). Asked for n > 1 it still draws ONE token and pads the
    other slots with -1 (empty), so its acceptance is sum min(p, q) for every n."""

    name = "chain"

    def propose(self, q: Tensor, n: int, generator: torch.Generator | None = None) -> Proposal:
        check_draws(n)
        tokens = draw_iid(q, 1, generator)
        pad = tokens.new_full((tokens.shape[0], n - 1), -1)
        return Proposal(token_ids=torch.cat([tokens, pad], -1), q=q)

    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        check_pair(p, proposal.q)
        token, _ = verify_one_draw(p, Proposal(token_ids=proposal.token_ids[:, :1], q=proposal.q), generator)
        return token, first_slot(proposal.token_ids, token)

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        check_pair(p, q)
        check_draws(n)
        m = greedy_masses(p, q, 1)
        return m[:, 0] - m[:, 1]


class RrsRule(_IidRule):
    """SpecInfer recursive rejection sampling of n i.i.d. draws."""

    name = "rrs"

    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        check_pair(p, proposal.q)
        if proposal.num_draws == 1:
            return verify_one_draw(p, proposal, generator)
        plan = greedy_plan(p, proposal.q, proposal.num_draws)
        return verify_sequential(p, proposal, plan, generator)

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        check_pair(p, q)
        m = greedy_masses(p, q, check_draws(n))
        return m[:, 0] - m[:, -1]


class KseqRule(_IidRule):
    """SpecTr K-SEQ: accept w.p. min(1, p / (rho* q)); residual norm((p - rho* q)+)."""

    name = "kseq"

    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        check_pair(p, proposal.q)
        n = proposal.num_draws
        if n == 1:  # rho* = 1: the scaled plan IS the chain plan, no solve
            return verify_one_draw(p, proposal, generator)
        # one row on CPU (the decoder's nodes): rho* located on a histogram (ResiSpecRule.verify); the plan's
        # masses are exact (scaled_plan), so a rho off by a bin costs acceptance only
        profile = histogram_profile(p, proposal.q, float(n)) if on_host(p) else None
        rho = solve_kseq_rho(p, proposal.q, n, profile)
        return verify_sequential(p, proposal, scaled_plan(p, proposal.q, n, rho), generator)

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        check_pair(p, q)
        rho = solve_kseq_rho(p, q, check_draws(n))  # no_grad: a constant for the gradient
        return capped_mass(p, q, rho)


class ResiSpecRule(_IidRule):
    """Optimal sequential residual shaping of n i.i.d. draws (DESIGN.md): alpha = sum min(p, T* q)."""

    name = "resispec"
    # Halvings of the T* bracket at verification time. Exactness holds for ANY T (module docstring); acceptance
    # loses at most (n - 1) 2^-14 < 2e-4 against T*, and the solve costs 2 grid rounds of 127 points (batches) or
    # 14 scalar bisection steps (one row) instead of 4 rounds (float32) or 7 (float64). acceptance() (losses,
    # reports) keeps the full precision.
    verify_halvings = 14
    # verify() locates T* on a histogram of p/q (ratio.HistogramProfile: O(V), no sort, no acceptance lost:
    # ratio.HISTOGRAM_BINS) and builds the plan on exact masses, for one row on CPU at every V (numpy, T bisected
    # on Python floats: the decoder's nodes, where the sort was the largest part of a node's cost) and for batches
    # from this vocabulary size; batches below it take the sorted profile
    histogram_min_vocab = 32768

    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        check_pair(p, proposal.q)
        n = proposal.num_draws
        if n == 1:  # the last draw is greedy whatever T: one draw IS the chain rule
            return verify_one_draw(p, proposal, generator)
        q = proposal.q
        if on_host(p) or p.shape[-1] >= self.histogram_min_vocab:
            # locate T* on a histogram (O(V), no sort), build the plan on exact masses (O(nV))
            t = solve_resispec_T(p, q, n, histogram_profile(p, q, float(n)), steps=self.verify_halvings)
            plan = shaped_plan(p, q, n, t, direct_mass(p, q))
        else:
            profile = RatioProfile.build(p, q)
            t = solve_resispec_T(p, q, n, profile, steps=self.verify_halvings)
            plan = shaped_plan(p, q, n, t, profile)
        return verify_sequential(p, proposal, plan, generator)

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        check_pair(p, q)
        t = solve_resispec_T(p, q, check_draws(n))  # no_grad: a constant for the gradient
        return capped_mass(p, q, t)
