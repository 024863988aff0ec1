"""Sampling exactness of EVERY rule in VERIFIERS (rules registered later are covered automatically).

Statistical bounds, derived from the sample size N per case (not tuned):
- emitted-token histogram p^ vs p: E|p^_x - p_x| <= sqrt(p_x (1 - p_x) / N) (Jensen), so
  E[TV] <= 0.5 sum_x sqrt(p_x (1 - p_x) / N). TV = max_A (p^(A) - p(A)) moves by at most 1/N when one sample
  changes, so McDiarmid gives P(TV >= E[TV] + eps) <= exp(-2 N eps^2); eps = sqrt(log(1/delta) / (2N)) with
  delta = 1e-6 per (rule, case) check.
- empirical acceptance (slot >= 0) vs the closed form alpha (rsd: the reference rsd_wor): within 4 standard
  errors sqrt(alpha (1 - alpha) / N); the variance is floored at 1/N so that alpha in {0, 1} tolerates float
  rounding of a few draws.
- large V: Pearson chi-square of the emitted tokens against p, tail tokens merged into bins with expected count
  >= 5; reject at significance 1e-4 (fixed seed).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from resispec.verify import VERIFIERS, covers
from tests.unit.test_verify_reference import grouped_by_n, load_cases

NUM_PER_CASE = 100_000  # node verifications per reference case, in the default run
DELTA = 1e-6
NUM_SE = 4.0


def tv_bound(p: torch.Tensor, num: int) -> torch.Tensor:
    """Derived TV bound (module docstring) for histograms of `num` samples; p [C, V] -> [C]."""
    expected = 0.5 * torch.sqrt(p * (1 - p) / num).sum(-1)
    return expected + math.sqrt(math.log(1 / DELTA) / (2 * num))


# every rule exact for any p (greedy, exact for one-hot p only, is covered by test_verify_properties)
SAMPLING_RULES = sorted(name for name, rule in VERIFIERS.items() if not rule.greedy_only)


def closed_form(
    name: str, p: torch.Tensor, q: torch.Tensor, n: int, group: list[dict]
) -> torch.Tensor | None:
    """The acceptance to compare with: the rule's closed form, rsd's reference value, or None (gumbel...)."""
    if name == "rsd":
        return torch.tensor([c["rsd_wor"] for c in group], dtype=torch.float64)
    rule = VERIFIERS[name]
    return rule.acceptance(p, q, n).double() if covers(rule.closed_form_draws, n) else None


def check_slots(tokens: torch.Tensor, token: torch.Tensor, slot: torch.Tensor) -> None:
    """slot is the first draw equal to the emitted token, -1 iff the token is not a draw."""
    hit = tokens == token[:, None]
    assert torch.equal(slot >= 0, hit.any(-1))
    ok = slot >= 0
    assert torch.equal(tokens[ok].gather(-1, slot[ok][:, None])[:, 0], token[ok])
    assert not (hit & (torch.arange(tokens.shape[1])[None] < slot[:, None])).any()


@pytest.fixture(scope="module")
def groups() -> list[tuple[int, list[dict], torch.Tensor, torch.Tensor]]:
    """Cases grouped by n, padded to a common V (see grouped_by_n)."""
    return grouped_by_n(load_cases())


@pytest.mark.parametrize("name", SAMPLING_RULES)
def test_sampling_exact_on_reference_cases(groups, name):
    check_sampling(groups, name, NUM_PER_CASE)


def test_resispec_histogram_path_exact_on_reference_cases(groups, monkeypatch):
    """resispec's large-vocabulary path (T* located on a histogram of p/q, plan on exact masses), forced at every V:
    still exact, and still at its closed-form acceptance (T within a bin width of T*)."""
    from resispec.verify.iid import ResiSpecRule

    monkeypatch.setattr(ResiSpecRule, "histogram_min_vocab", 0)
    # at these tiny V the histogram has only V bins, so T is coarse: exactness is checked here, the acceptance of
    # the path (T within a few bins of T*) by test_verify_properties at the default bins
    check_sampling(groups, "resispec", NUM_PER_CASE // 10, acceptance=False)


def check_sampling(groups, name: str, num_per_case: int, acceptance: bool = True) -> None:
    """Each case repeated num_per_case times, verified in one batch per n; TV and acceptance bounds."""
    rule = VERIFIERS[name]
    gen = torch.Generator().manual_seed(1234)
    for n, group, p64, q64 in groups:
        num_cases, vocab = p64.shape
        # float32 rows, each case repeated num_per_case times: [C * N, V]
        p = p64.float().repeat_interleave(num_per_case, 0)
        q = q64.float().repeat_interleave(num_per_case, 0)
        proposal = rule.propose(q, n, gen)
        assert proposal.token_ids.shape == (p.shape[0], n) and proposal.token_ids.dtype == torch.long
        token, slot = rule.verify(p, proposal, gen)
        check_slots(proposal.token_ids, token, slot)
        case_id = torch.arange(num_cases).repeat_interleave(num_per_case)
        hist = torch.bincount(case_id * vocab + token, minlength=num_cases * vocab).view(num_cases, vocab)
        tv = 0.5 * (hist.double() / num_per_case - p64).abs().sum(-1)
        bound = tv_bound(p64, num_per_case)
        assert (tv <= bound).all(), (name, n, tv.tolist(), bound.tolist())

        want = closed_form(name, p64, q64, n, group)
        if want is None or not acceptance:
            continue
        acc = (
            torch.zeros(num_cases, dtype=torch.float64).index_add_(0, case_id, (slot >= 0).double())
            / num_per_case
        )
        se = torch.sqrt(torch.clamp(want * (1 - want), min=1 / num_per_case) / num_per_case)
        z = (acc - want).abs() / se
        assert (z <= NUM_SE).all(), (name, n, acc.tolist(), want.tolist())


# ---------------------------------------------------------------------------------------------- large V

LARGE_V = 32_768
LARGE_N = 4
LARGE_SAMPLES = 1_024
LARGE_BATCH = 512


@pytest.fixture(scope="module")
def large_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random pair at V = 32k: a peaked target and a correlated, noisier draft. [1, V] float32."""
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(1, LARGE_V, generator=gen)
    p = torch.softmax(2.5 * z, -1)
    q = torch.softmax(2.2 * z + 0.8 * torch.randn(1, LARGE_V, generator=gen), -1)
    return p, q


def binned_counts(p: np.ndarray, counts: np.ndarray, num: int) -> tuple[np.ndarray, np.ndarray]:
    """Observed and expected counts with every bin expecting >= 5: big tokens alone, the tail (sorted by p)
    merged into consecutive bins."""
    expected = p * num
    order = np.argsort(-expected)
    exp_s, obs_s = expected[order], counts[order]
    alone = exp_s >= 5
    tail_e, tail_o = exp_s[~alone], obs_s[~alone]
    bin_id = np.floor(np.cumsum(tail_e) / 5).astype(int)
    bin_id = np.minimum(bin_id, max(bin_id.max() - 1, 0))  # the last partial bin joins the previous one
    be = np.bincount(bin_id, weights=tail_e)
    bo = np.bincount(bin_id, weights=tail_o)
    return np.concatenate([obs_s[alone], bo]), np.concatenate([exp_s[alone], be])


@pytest.mark.parametrize("name", SAMPLING_RULES)
def test_large_vocab_chi_square(large_pair, name):
    p1, q1 = large_pair
    rule = VERIFIERS[name]
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(LARGE_V, dtype=torch.long)
    accepted = 0
    for _ in range(LARGE_SAMPLES // LARGE_BATCH):
        p, q = p1.expand(LARGE_BATCH, -1).contiguous(), q1.expand(LARGE_BATCH, -1).contiguous()
        token, slot = rule.verify(p, rule.propose(q, LARGE_N, gen), gen)
        counts += torch.bincount(token, minlength=LARGE_V)
        accepted += int((slot >= 0).sum())
    obs, exp = binned_counts(p1[0].double().numpy(), counts.numpy(), LARGE_SAMPLES)
    exp = exp * obs.sum() / exp.sum()  # float32 p sums to 1 only up to rounding
    result = stats.chisquare(obs, exp)
    assert result.pvalue > 1e-4, (name, result)
    if not covers(rule.closed_form_draws, LARGE_N):
        return
    # the fast float32 CPU path (sorted ratio profile) must also give the closed-form acceptance
    alpha = rule.acceptance(p1.double(), q1.double(), LARGE_N).item()
    se = math.sqrt(max(alpha * (1 - alpha), 1 / LARGE_SAMPLES) / LARGE_SAMPLES)
    assert abs(accepted / LARGE_SAMPLES - alpha) <= NUM_SE * se, (name, accepted / LARGE_SAMPLES, alpha)


def test_draw_distinct_is_sampling_without_replacement():
    """base.draw_distinct (rsd's and resispec_wor's draws): the ordered draws follow sampling without replacement,
    P(a, b, c) = q_a q_b / (1 - q_a) q_c / (1 - q_a - q_b), the law of Gumbel-top-n (chi-square over the 24
    ordered triples); a q = 0 token is never drawn, and slots past q's support are -1."""
    from itertools import permutations

    from resispec.verify.base import draw_distinct

    num = 200_000
    q1 = torch.tensor([0.45, 0.0, 0.3, 0.15, 0.1], dtype=torch.float64)
    draws = draw_distinct(q1.expand(num, -1).contiguous(), 3, torch.Generator().manual_seed(0))
    support = [0, 2, 3, 4]
    triples = list(permutations(support, 3))
    code = {t: i for i, t in enumerate(triples)}
    got = np.bincount([code[tuple(row)] for row in draws.tolist()], minlength=len(triples))
    assert got.sum() == num  # every row: three distinct tokens of q's support, never token 1 (q = 0)
    want = np.array([q1[a] * q1[b] / (1 - q1[a]) * q1[c] / (1 - q1[a] - q1[b]) for a, b, c in triples])
    assert stats.chisquare(got, num * want / want.sum()).pvalue > DELTA
    # two tokens of support, four slots: both drawn (in either order), then -1
    short = torch.tensor([[0.0, 0.7, 0.0, 0.3]]).expand(1000, -1).contiguous()
    d = draw_distinct(short, 4, torch.Generator().manual_seed(1))
    assert (d[:, 2:] == -1).all() and (d[:, :2].sort(-1).values == torch.tensor([1, 3])).all()
    frac_first = (d[:, 0] == 1).double().mean().item()
    assert abs(frac_first - 0.7) < 4 * math.sqrt(0.21 / 1000)
