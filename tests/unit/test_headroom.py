"""The headroom tool's data side: the α*_wor prefix bound, Monte Carlo α, auto calibration and the report files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resispec.analysis.headroom import AUTO, calibrate_policy, markdown_table, plot, summarize, token_windows
from resispec.verify import VERIFIERS, optimal_acceptance
from resispec.verify.auto import AutoPolicy
from resispec.verify.bounds import wor_prefix_bound
from resispec.verify.estimate import monte_carlo_alpha, per_node_alpha

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_pairs(num: int, vocab: int, seed: int, scale: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(num, vocab, generator=gen, dtype=torch.float64) * scale
    p = torch.softmax(z, -1)
    q = torch.softmax(z + torch.randn(num, vocab, generator=gen, dtype=torch.float64) * scale, -1)
    return p, q


def test_wor_prefix_bound_n2_matches_enumeration() -> None:
    """n = 2: the sorted-prefix formula is a valid upper bound and equals the exhaustive α*_wor on these cases."""
    p, q = _random_pairs(40, 7, seed=0)
    exact = optimal_acceptance(p, q, 2, scheme="wor")
    bound = wor_prefix_bound(p, q, 2)
    assert bool((bound >= exact - 1e-9).all())
    torch.testing.assert_close(bound, exact, atol=1e-9, rtol=0)


@pytest.mark.parametrize("n", [3, 4])
def test_wor_prefix_bound_n_gt_2_is_an_upper_bound(n: int) -> None:
    """n > 2: the bracketed race integral keeps it >= α*_wor; the bracket is tight to well under 1e-2."""
    p, q = _random_pairs(12, 6, seed=n)
    exact = optimal_acceptance(p, q, n, scheme="wor")
    bound = wor_prefix_bound(p, q, n)
    assert bool((bound >= exact - 1e-9).all())
    assert float((bound - exact).max()) < 1e-2


def test_monte_carlo_alpha_matches_closed_form() -> None:
    """rrs has a closed form: its Monte Carlo estimate must agree within 4.5 standard errors per node."""
    p, q = _random_pairs(6, 50, seed=1)
    gen = torch.Generator().manual_seed(0)
    rate, se = monte_carlo_alpha(VERIFIERS["rrs"], p, q, 3, 4000, gen)
    alpha = VERIFIERS["rrs"].acceptance(p, q, 3).double()
    assert bool(((rate - alpha).abs() <= 4.5 * se + 1e-12).all())


def test_per_node_alpha_methods_and_bounds() -> None:
    p, q = _random_pairs(5, 40, seed=2)
    gen = torch.Generator().manual_seed(0)
    out = per_node_alpha(p, q, 2, ["resispec", "gumbel", "resispec_wor"], 200, gen)
    assert out["resispec"]["method"] == "closed form" and out["resispec_wor"]["method"] == "closed form"
    assert out["gumbel"]["method"] == "monte carlo" and bool((out["gumbel"]["se"] > 0).any())
    assert bool((out["resispec"]["alpha"] <= out["alpha*_iid"]["alpha"] + 1e-9).all())
    assert bool((out["resispec_wor"]["alpha"] <= out["alpha*_wor"]["alpha"] + 1e-9).all())


def test_calibration_picks_the_better_branch_per_node(tmp_path: Path) -> None:
    """Synthetic per-node α where distinct wins exactly on confident nodes: calibration must find a threshold
    that separates them, and the report files are written."""
    feature = torch.tensor([0.1, 0.2, 0.5, 0.7])
    iid = torch.tensor([0.8, 0.7, 0.5, 0.4], dtype=torch.float64)
    dist = torch.tensor([0.7, 0.6, 0.6, 0.6], dtype=torch.float64)
    zero = torch.zeros(4, dtype=torch.float64)

    def per_node():
        return {
            "resispec": {"alpha": iid, "se": zero, "method": "closed form"},
            "gumbel": {"alpha": dist, "se": zero + 0.01, "method": "monte carlo"},
        }

    results = {(t, n): {"per_node": per_node(), "feature": feature} for t in (1.0, 0.6) for n in (2, 4)}
    policy = calibrate_policy(results, [2, 4], candidates=("gumbel",))
    assert isinstance(policy, AutoPolicy) and policy.distinct_rule == "gumbel"
    for n in (2, 4):
        assert 0.2 < policy.threshold_for(n) <= 0.5
    summary = {}
    for (t, n), r in results.items():
        rows = dict(r["per_node"])
        mask = feature >= policy.threshold_for(n)
        rows[AUTO] = {"alpha": torch.where(mask, dist, iid), "se": zero, "method": "auto"}
        rows["oracle"] = {"alpha": torch.maximum(dist, iid), "se": zero, "method": "max"}
        rows["alpha*_iid"] = rows["alpha*_wor"] = {"alpha": zero + 1, "se": zero, "method": "bound"}
        summary[f"n={n},T={t}"] = summarize(rows)
    assert summary["n=2,T=1.0"][AUTO]["mean"] == pytest.approx(float(torch.maximum(dist, iid).mean()))
    table = markdown_table(summary, ["gumbel", "resispec"], [1.0, 0.6], [2, 4])
    assert table.count("\n") == 1 + 4 and "**" in table
    plot(summary, ["gumbel", "resispec"], [1.0, 0.6], [2, 4], tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 1000
    policy.save(tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["distinct_rule"] == "gumbel"


def test_token_windows_round_robin() -> None:
    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text)))}

    wins = token_windows(Tok(), ["a" * 100, "b" * 30], num_windows=4, window=40, min_context=8)
    assert [len(w) for w in wins] == [40, 30, 40, 20]
