"""resispec.verify against the reference values (tests/data/verify_cases.json, float64; a copy of the project's
shared/testdata/verify_cases.json, vendored so that every clone runs these tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resispec.verify import VERIFIERS, optimal_acceptance, solve_kseq_rho, solve_resispec_T
from resispec.verify.iid import _resispec_g
from resispec.verify.ratio import RatioProfile

CASES_PATH = Path(__file__).resolve().parents[1] / "data" / "verify_cases.json"
TOL = 1e-6
# rule -> key of its closed-form acceptance in the reference file
REFERENCE_KEYS = {
    "onehot": "onehot_topk",
    "rrs": "rrs_iid",
    "kseq": "kseq",
    "hub": "hub",
    "resispec": "resispec",
}


def load_cases() -> list[dict]:
    """The reference test vectors (45 cases), from the repository itself: never skipped."""
    return json.loads(CASES_PATH.read_text())["cases"]


def case_pair(case: dict, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor, int]:
    """p, q as [1, V] tensors and n of one case."""
    return torch.tensor([case["p"]], dtype=dtype), torch.tensor([case["q"]], dtype=dtype), case["n"]


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return load_cases()


@pytest.mark.parametrize("rule", sorted(REFERENCE_KEYS))
def test_acceptance_matches_reference(cases, rule):
    for i, case in enumerate(cases):
        p, q, n = case_pair(case)
        got = VERIFIERS[rule].acceptance(p, q, n).item()
        assert abs(got - case[REFERENCE_KEYS[rule]]) < TOL, (rule, i, got, case[REFERENCE_KEYS[rule]])


@pytest.mark.parametrize("scheme,key", [("iid", "opt_iid"), ("wor", "opt_wor")])
def test_optimal_acceptance_matches_reference(cases, scheme, key):
    for i, case in enumerate(cases):
        p, q, n = case_pair(case)
        got = optimal_acceptance(p, q, n, scheme=scheme).item()
        assert abs(got - case[key]) < TOL, (scheme, i, got, case[key])


def test_chain_is_sum_min(cases):
    for case in cases:
        p, q, n = case_pair(case)
        for num in (1, n):  # chain drafts one token whatever n is
            got = VERIFIERS["chain"].acceptance(p, q, num)
            torch.testing.assert_close(got, torch.minimum(p, q).sum(-1), rtol=0, atol=1e-12)


def test_kseq_rho_matches_reference(cases):
    for i, case in enumerate(cases):
        p, q, n = case_pair(case)
        assert abs(solve_kseq_rho(p, q, n).item() - case["kseq_rho"]) < TOL, i


def test_resispec_T_matches_reference(cases):
    """T* is unique while alpha < 1. When full acceptance is reachable, g(T) = 0 on a whole interval: there we
    check that both T's are roots with alpha = 1, and that ours is the smallest (it shapes the least)."""
    for i, case in enumerate(cases):
        p, q, n = case_pair(case)
        t = solve_resispec_T(p, q, n)
        if case["resispec"] < 1 - 1e-9:
            assert abs(t.item() - case["resispec_T"]) < TOL, (i, t.item(), case["resispec_T"])
            continue
        profile = RatioProfile.build(p, q)
        total = p.sum(-1)
        t_ref = torch.tensor([case["resispec_T"]], dtype=torch.float64)
        for root in (t, t_ref):
            assert abs(_resispec_g(profile, total, root, n).item()) < TOL, i
            assert abs(torch.minimum(p, root[:, None] * q).sum().item() - 1) < TOL, i
        assert t.item() <= t_ref.item() + TOL


def grouped_by_n(cases: list[dict]) -> list[tuple[int, list[dict], torch.Tensor, torch.Tensor]]:
    """Cases grouped by n, padded to a common V with p = q = 0 tokens (never drawn, never emitted):
    [(n, group, p [C, V], q [C, V])] in float64."""
    vocab = max(len(c["p"]) for c in cases)
    out = []
    for n in sorted({c["n"] for c in cases}):
        group = [c for c in cases if c["n"] == n]
        p = torch.zeros(len(group), vocab, dtype=torch.float64)
        q = torch.zeros_like(p)
        for row, c in enumerate(group):
            p[row, : len(c["p"])] = torch.tensor(c["p"], dtype=torch.float64)
            q[row, : len(c["q"])] = torch.tensor(c["q"], dtype=torch.float64)
        out.append((n, group, p, q))
    return out


def test_batched_equals_single(cases):
    """All cases at once (padded with p = q = 0 tokens) give the same acceptance as one by one."""
    for n, group, p, q in grouped_by_n(cases):
        for rule, key in REFERENCE_KEYS.items():
            want = torch.tensor([c[key] for c in group], dtype=torch.float64)
            torch.testing.assert_close(VERIFIERS[rule].acceptance(p, q, n), want, rtol=0, atol=TOL)
        want = torch.tensor([c["opt_iid"] for c in group], dtype=torch.float64)
        torch.testing.assert_close(optimal_acceptance(p, q, n), want, rtol=0, atol=TOL)


@pytest.mark.parametrize("rule", ["rsd", "gumbel"])
def test_rules_without_closed_form_raise(rule):
    p = torch.tensor([[0.5, 0.5]])
    with pytest.raises(NotImplementedError):
        VERIFIERS[rule].acceptance(p, p, 2)
