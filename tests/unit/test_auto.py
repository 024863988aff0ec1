"""resispec_auto (per-node scheme choice) and resispec_wor (shaping for distinct draws): exactness and acceptance.

Statistical bounds: chi-square quantiles at a fixed small tail probability, and 4.5 standard errors for Monte Carlo
acceptance rates (two-sided tail ~7e-6 per check), all derived from the sample sizes used.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy.stats import chi2

from resispec.verify import VERIFIERS
from resispec.verify.auto import (
    AutoPolicy,
    AutoProposal,
    ResiSpecAutoRule,
    confidence_feature,
    default_policy,
)
from resispec.verify.registry import auto_rule, build_rule
from resispec.verify.wor import choose_lambda, residual_after_reject, two_step_value
from tests.unit.test_verify_reference import load_cases

TAIL = 1e-5  # chi-square tail probability per test


pytestmark = pytest.mark.usefixtures("one_thread")


def _mixed_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """4 nodes over V = 6: two flat drafts, two confident ones (max q > 0.3), one with q = 0 entries."""
    p = torch.tensor(
        [
            [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
            [0.05, 0.50, 0.20, 0.10, 0.10, 0.05],
            [0.10, 0.10, 0.40, 0.20, 0.10, 0.10],
            [0.20, 0.05, 0.05, 0.30, 0.30, 0.10],
        ],
        dtype=torch.float64,
    )
    q = torch.tensor(
        [
            [0.18, 0.16, 0.17, 0.16, 0.17, 0.16],  # flat -> i.i.d.
            [0.70, 0.10, 0.10, 0.05, 0.05, 0.00],  # confident, q = 0 on a token p likes a little
            [0.20, 0.15, 0.20, 0.15, 0.15, 0.15],  # flat -> i.i.d.
            [0.05, 0.05, 0.05, 0.45, 0.40, 0.00],  # confident
        ],
        dtype=torch.float64,
    )
    return p, q


def _chi2_check(tokens: torch.Tensor, p_row: torch.Tensor) -> None:
    """Pearson chi-square of sampled tokens against p_row (cells with p > 0; p = 0 cells must stay empty)."""
    counts = torch.bincount(tokens, minlength=p_row.numel()).double()
    assert counts[p_row == 0].sum() == 0, "a token with p = 0 was emitted"
    pos = p_row > 0
    expected = p_row[pos] * tokens.numel()
    stat = float(((counts[pos] - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(1 - TAIL, int(pos.sum()) - 1), stat


def _repeat(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.repeat_interleave(k, dim=0)


@pytest.mark.parametrize("distinct_rule", ["gumbel", "rsd", "resispec_wor"])
@pytest.mark.parametrize("n", [2, 4])
def test_auto_mixed_batch_is_exact(distinct_rule: str, n: int) -> None:
    k = 10_000
    p, q = _mixed_pair()
    rule = auto_rule(AutoPolicy(threshold=0.3, distinct_rule=distinct_rule))
    gen = torch.Generator().manual_seed(1234 + n)
    pp, qq = _repeat(p, k), _repeat(q, k)
    proposal = rule.propose(qq, n, gen)
    assert isinstance(proposal, AutoProposal) and proposal.token_ids.shape == (4 * k, n)
    mask = proposal.distinct_mask.view(4, k)
    assert mask[:, 0].tolist() == [False, True, False, True]  # both branches in one batch
    assert bool((mask == mask[:, :1]).all())  # the choice depends on q only
    # distinct rows never repeat a token; their empty slots are past q's support only
    d_tok = proposal.token_ids.view(4, k, n)[1]
    real = d_tok[d_tok >= 0].view(k, -1)
    assert bool((real.sort(-1).values.diff(dim=-1) != 0).all())
    token, slot = rule.verify(pp, proposal, gen)
    hit = slot >= 0
    assert bool((proposal.token_ids.gather(-1, slot.clamp_min(0)[:, None])[:, 0] == token)[hit].all())
    for b in range(4):
        _chi2_check(token.view(4, k)[b], p[b])
    # i.i.d. rows: the Monte Carlo acceptance agrees with the closed form
    alpha = VERIFIERS["resispec"].acceptance(p, q, n)
    rate = hit.view(4, k).double().mean(-1)
    for b in (0, 2):
        se = (alpha[b] * (1 - alpha[b]) / k).sqrt()
        assert abs(rate[b] - alpha[b]) < 4.5 * se + 1e-12


@pytest.mark.parametrize("name", ["resispec_auto", "gumbel", "hub", "rsd", "resispec"])
def test_rows_selected_and_joined_again_are_the_proposal(name: str) -> None:
    """Proposal.cat (and AutoProposal.cat) of the rows that select() cut out gives back the proposal: the walk
    verifies a run of nodes taken from several levels as one proposal (lean.chain_from)."""
    p, q = _mixed_pair()
    rule = auto_rule(AutoPolicy(threshold=0.3)) if name == "resispec_auto" else VERIFIERS[name]
    proposal = rule.propose(q, 2, torch.Generator().manual_seed(0))
    order = [2, 0, 3, 1]
    joined = type(proposal).cat([proposal.select(i) for i in order])
    assert type(joined) is type(proposal)

    def same(a, b) -> None:
        for field in ("token_ids", "q", "draw_probs", "noise", "top_ids", "distinct_mask"):
            x, y = getattr(a, field, None), getattr(b, field, None)
            assert (x is None) == (y is None), field
            assert x is None or torch.equal(x[order] if x.shape[0] == 4 else x, y), field

    same(proposal, joined)
    if name == "resispec_auto":  # each branch's rows in the joined order
        for part in ("iid_part", "distinct_part"):
            rows = [i for i in order if bool(proposal.distinct_mask[i]) == (part == "distinct_part")]
            want = torch.cat([getattr(proposal.select(i), part).token_ids for i in rows])
            assert torch.equal(getattr(joined, part).token_ids, want)
    # verifying the joined rows verifies each row: same emitted token law, here the same slots' meaning
    token, slot = rule.verify(p[order], joined, torch.Generator().manual_seed(1))
    hit = slot >= 0
    assert bool((joined.token_ids.gather(-1, slot.clamp_min(0)[:, None])[:, 0] == token)[hit].all())
    if name == "resispec_auto":  # rows of a proposal with distinct rows next to one whose rows are all i.i.d.
        flat = rule.propose(q[[0, 2]], 2, torch.Generator().manual_seed(2))
        assert proposal.noise is not None and flat.noise is None and not bool(flat.distinct_mask.any())
        mixed = AutoProposal.cat([proposal.select(1), flat.select(0), flat.select(1)])
        assert torch.equal(mixed.noise[1:], torch.zeros(2, q.shape[1], dtype=q.dtype))  # i.i.d. rows: noise 0
        assert torch.equal(mixed.noise[:1], proposal.noise[1:2])
        token, slot = rule.verify(p[[1, 0, 2]], mixed, torch.Generator().manual_seed(3))
        assert token.shape == (3,) and bool((token >= 0).all())


def test_auto_acceptance_branches() -> None:
    p, q = _mixed_pair()
    gum = auto_rule(AutoPolicy(threshold=0.3, distinct_rule="gumbel"))
    with pytest.raises(NotImplementedError):
        gum.acceptance(p, q, 2)
    iid_alpha = VERIFIERS["resispec"].acceptance(p, q, 2)
    torch.testing.assert_close(gum.surrogate_acceptance(p, q, 2), iid_alpha)
    flat = torch.tensor([0, 2])
    torch.testing.assert_close(gum.acceptance(p[flat], q[flat], 2), iid_alpha[flat])  # all i.i.d.: exact
    wor = auto_rule(AutoPolicy(threshold=0.3, distinct_rule="resispec_wor"))
    expect = torch.where(
        torch.tensor([False, True, False, True]), VERIFIERS["resispec_wor"].acceptance(p, q, 2), iid_alpha
    )
    torch.testing.assert_close(wor.acceptance(p, q, 2), expect)


def test_auto_policy_table_and_json(tmp_path: Path) -> None:
    q = torch.tensor([[0.5, 0.3, 0.2], [0.34, 0.33, 0.33]])
    pol = AutoPolicy(feature="max_q", threshold=0.9, thresholds={2: 0.4})
    assert pol.distinct_rows(q, 2).tolist() == [True, False]
    assert pol.distinct_rows(q, 4).tolist() == [False, False]
    ent = AutoPolicy(feature="entropy", threshold=1.05)
    assert confidence_feature(q, "entropy")[1] > 1.05 > confidence_feature(q, "entropy")[0]
    assert ent.distinct_rows(q, 2).tolist() == [True, False]
    pol.save(tmp_path / "policy.json")
    back = AutoPolicy.load(tmp_path / "policy.json")
    assert back == pol and back.thresholds == {2: 0.4}
    with pytest.raises(ValueError):
        AutoPolicy(feature="nope")
    per_n = AutoPolicy(threshold=0.0, distinct_rule="gumbel", distinct_rules={"4": "rsd"})
    per_n.save(tmp_path / "per_n.json")
    per_n = AutoPolicy.load(tmp_path / "per_n.json")
    assert per_n.distinct_rule_for(4) == "rsd" and per_n.distinct_rule_for(2) == "gumbel"
    rule = auto_rule(per_n)
    gen = torch.Generator().manual_seed(0)
    assert rule.propose(q, 4, gen).distinct_part.draw_probs is not None  # rsd's proposal
    assert rule.propose(q, 2, gen).distinct_part.draw_probs is None  # gumbel's


@pytest.mark.parametrize("n", [2, 3, 4])
def test_resispec_wor_is_exact_by_sampling(n: int) -> None:
    """Including rows whose q has fewer than n positive tokens (empty draw slots)."""
    k = 20_000
    p = torch.tensor([[0.3, 0.3, 0.2, 0.1, 0.1], [0.1, 0.2, 0.3, 0.2, 0.2], [0.5, 0.0, 0.1, 0.2, 0.2]])
    q = torch.tensor([[0.05, 0.1, 0.6, 0.15, 0.1], [0.0, 0.0, 0.0, 0.5, 0.5], [0.2, 0.4, 0.3, 0.1, 0.0]])
    rule = VERIFIERS["resispec_wor"]
    gen = torch.Generator().manual_seed(99 + n)
    proposal = rule.propose(_repeat(q, k), n, gen)
    token, slot = rule.verify(_repeat(p, k), proposal, gen)
    for b in range(3):
        _chi2_check(token.view(3, k)[b], p[b].double())
    if n == 2:  # closed form vs Monte Carlo (row 1 has support 2 = n, so the closed form applies)
        alpha = rule.acceptance(p.double(), q.double(), 2)
        rate = (slot >= 0).view(3, k).double().mean(-1)
        se = (alpha * (1 - alpha) / k).sqrt()
        assert bool(((rate - alpha).abs() < 4.5 * se + 1e-12).all()), (rate, alpha)


def test_resispec_wor_transport_is_exact() -> None:
    """The residual rows after a rejection average back to the step's residual R = p - c (the exactness identity),
    for every lam, computed exactly over all rejected tokens."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, 7, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(8, 7, generator=gen, dtype=torch.float64) * 2, -1)
    for lam_value in (0.0, 0.3, 0.9):
        lam = torch.full((8, 1), lam_value, dtype=torch.float64)
        c = torch.minimum((p - lam * q).clamp_min(0), q)
        r = q - c
        total = torch.zeros_like(p)
        for x in range(7):
            rows = residual_after_reject(p, q, lam, torch.full((8,), x))
            total += r[:, x : x + 1] * rows
        torch.testing.assert_close(total, p - c, atol=1e-12, rtol=0)


def test_resispec_wor_closed_form_beats_rsd_at_n2() -> None:
    """On the shared cases with n = 2: rsd <= resispec_wor <= alpha*_wor (stored values), deterministically."""
    rows = [c for c in load_cases() if c["n"] == 2 and sum(x > 0 for x in c["q"]) >= 2]
    assert rows
    gains = []
    for c in rows:
        p = torch.tensor([c["p"]], dtype=torch.float64)
        q = torch.tensor([c["q"]], dtype=torch.float64)
        a = float(VERIFIERS["resispec_wor"].acceptance(p, q, 2))
        assert c["rsd_wor"] - 1e-9 <= a <= c["opt_wor"] + 1e-9, (c, a)
        gains.append(a - c["rsd_wor"])
    assert sum(gains) > 0


def test_choose_lambda_includes_rsd_step() -> None:
    """lam = 0 is on the grid, so the chosen two-step value is never below the lam = 0 value."""
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(16, 40, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(16, 40, generator=gen, dtype=torch.float64) * 2, -1)
    best = two_step_value(p, q, choose_lambda(p, q))
    zero = two_step_value(p, q, torch.zeros(16, 1, dtype=torch.float64))
    assert bool((best >= zero - 1e-12).all())


def test_resispec_wor_acceptance_is_differentiable() -> None:
    """The n = 2 closed form is usable as a training loss: finite, nonzero gradient w.r.t. the draft logits."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 30, generator=gen, requires_grad=True)
    p = torch.softmax(torch.randn(4, 30, generator=gen), -1)
    alpha = VERIFIERS["resispec_wor"].acceptance(p, torch.softmax(logits, -1), 2)
    alpha.sum().backward()
    assert torch.isfinite(logits.grad).all() and float(logits.grad.abs().sum()) > 0


def test_two_policies_coexist_and_come_from_config(tmp_path: Path) -> None:
    """Policies are data: two resispec_auto rules with different policies live side by side, the registered one
    keeps the default, and `decode.auto_policy` may be a JSON path or inline values."""
    AutoPolicy(threshold=0.9, distinct_rule="rsd").save(tmp_path / "policy.json")
    from_file = build_rule("resispec_auto", str(tmp_path / "policy.json"))
    inline = build_rule("resispec_auto", {"threshold": 0.1, "distinct_rule": "gumbel"})
    assert isinstance(from_file, ResiSpecAutoRule) and isinstance(inline, ResiSpecAutoRule)
    assert from_file is not inline and from_file.policy.threshold == 0.9 and inline.policy.threshold == 0.1
    assert (
        VERIFIERS["resispec_auto"].policy == default_policy()
        and build_rule("resispec_auto") is VERIFIERS["resispec_auto"]
    )
    q = torch.tensor([[0.5, 0.3, 0.2]])
    assert from_file.branch_names(q, 2) == ["resispec"] and inline.branch_names(q, 2) == ["gumbel"]
    # declared capabilities instead of NotImplementedError: gumbel has no closed form, resispec_wor up to n = 2
    assert inline.closed_form_draws == 0 and inline.surrogate_draws is None
    assert auto_rule(AutoPolicy(distinct_rule="resispec_wor")).closed_form_draws == 2
    assert (
        auto_rule(AutoPolicy(distinct_rule="resispec_wor", distinct_rules={2: "rsd"})).closed_form_draws == 1
    )
    with pytest.raises(ValueError, match="iid"):
        ResiSpecAutoRule(
            AutoPolicy(iid_rule="rrs"), iid=VERIFIERS["resispec"], distinct={"gumbel": VERIFIERS["gumbel"]}
        )


# ---------------------------------------------------------------------------------------------- never below a branch


def _logit_pairs(num: int, vocab: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p = softmax(scale z), q = softmax(scale z + e): the random pairs of issue 42 (z, e ~ N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(num, vocab, generator=gen, dtype=torch.float64)
    e = torch.randn(num, vocab, generator=gen, dtype=torch.float64)
    return torch.softmax(scale * z, -1), torch.softmax(scale * z + e, -1)


def test_auto_at_one_draw_is_the_iid_rule() -> None:
    """n = 1: every scheme is one draw from q, and the i.i.d. rule's step (standard speculative sampling) is the
    optimal coupling. resispec_auto must be exactly that step on every node, confident drafts included: no row
    distinct, the same tokens as resispec for the same seed, and the closed form sum min(p, q). (Before the fix it
    took gumbel on confident nodes: .318 against .406 on V = 16.)"""
    auto, iid, chain = VERIFIERS["resispec_auto"], VERIFIERS["resispec"], VERIFIERS["chain"]
    p, q = _logit_pairs(64, 16, 3.0, seed=1)
    assert bool((q.max(-1).values >= 0.3).any()), "the case must hold confident drafts"
    assert not bool(auto.policy.distinct_rows(q, 1).any())
    assert auto.one_draw_is_standard
    torch.testing.assert_close(auto.acceptance(p, q, 1), chain.acceptance(p, q, 1), rtol=0, atol=1e-12)
    # the i.i.d. rule's own proposal, without the two-branch bookkeeping (a chain's levels select and join it)
    assert type(auto.propose(q, 1, torch.Generator().manual_seed(0))) is type(iid.propose(q, 1, None))
    for seed in range(5):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        got = auto.verify(p, auto.propose(q, 1, g1), g1)
        want = iid.verify(p, iid.propose(q, 1, g2), g2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed
    # a calibrated policy cannot send n = 1 anywhere else either
    forced = auto_rule(AutoPolicy(threshold=0.0, thresholds={1: 0.0}))
    assert not bool(forced.policy.distinct_rows(q, 1).any())


def _mean_alpha(rule, p, q, n, samples, seed) -> tuple[float, float]:
    """Mean per-node acceptance over the nodes and its standard error (closed form: SE 0)."""
    from resispec.verify.base import covers
    from resispec.verify.estimate import monte_carlo_alpha

    if covers(rule.closed_form_draws, n) and rule.name != "resispec_auto":
        return float(rule.acceptance(p, q, n).double().mean()), 0.0
    rate, _ = monte_carlo_alpha(rule, p, q, n, samples, torch.Generator().manual_seed(seed))
    # rows are independent Bernoulli means: the SE of the grand mean from the per-row variances
    return float(rate.mean()), float((rate * (1 - rate) / samples).sum().sqrt() / rate.numel())


def test_mean_acceptance_samples_only_the_rows_without_a_closed_form(monkeypatch) -> None:
    """The planner's alpha for resispec_auto at n = 3 (its distinct branch, gumbel, has no closed form): the i.i.d.
    rows get resispec's closed form and only the distinct rows are sampled, and the mean agrees with sampling every
    row; at n = 1 (no row distinct) nothing is sampled."""
    from resispec.verify import estimate

    auto = VERIFIERS["resispec_auto"]
    p, q = (x.float() for x in _logit_pairs(300, 16, 3.0, seed=3))
    distinct = auto.policy.distinct_rows(q.double(), 3)
    assert 0 < int(distinct.sum()) < len(q), "the case must mix the branches"
    sampled_rows = []
    real = estimate.monte_carlo_alpha

    def spy(rule, pp, qq, n, samples, generator):
        sampled_rows.append(len(qq))
        return real(rule, pp, qq, n, samples, generator)

    monkeypatch.setattr(estimate, "monte_carlo_alpha", spy)
    got = estimate.mean_acceptance(auto, p, q, 3, 4000, torch.Generator().manual_seed(0))
    assert sampled_rows == [int(distinct.sum())]
    rate, _ = real(auto, p, q, 3, 4000, torch.Generator().manual_seed(1))
    se = float((rate * (1 - rate) / 4000).sum().sqrt() / len(rate))
    assert abs(got - float(rate.mean())) < 4.5 * se * 2**0.5 + 1e-9, (got, float(rate.mean()), se)
    iid_rows = ~distinct
    torch.testing.assert_close(
        auto.closed_form_rows(q.double(), 3), iid_rows, msg="the i.i.d. rows are the closed-form ones"
    )
    sampled_rows.clear()
    one = estimate.mean_acceptance(auto, p, q, 1, 4000, torch.Generator().manual_seed(0))
    assert sampled_rows == [] and one == pytest.approx(float(VERIFIERS["chain"].acceptance(p, q, 1).mean()))


def _assert_auto_not_below_branches(p, q, draws, samples, what) -> dict:
    auto = VERIFIERS["resispec_auto"]
    out = {}
    for n in draws:
        a, a_se = _mean_alpha(auto, p, q, n, samples, seed=10 + n)
        for name in ("resispec", auto.policy.distinct_rule_for(n)):
            b, b_se = _mean_alpha(VERIFIERS[name], p, q, n, samples, seed=20 + n)
            slack = 4.5 * (a_se**2 + b_se**2) ** 0.5
            assert a >= b - slack, (what, n, name, a, b, slack)
            out[(n, name)] = (a, b)
    return out


@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0])
def test_auto_is_never_below_its_branches_on_random_pairs(scale: float) -> None:
    """Mean per-node α of resispec_auto (Monte Carlo of the rule itself) >= that of resispec (closed form) and of its
    distinct rule (Monte Carlo) minus 4.5 standard errors, n = 1..4, flat to peaked pairs over V = 16. The old
    n = 1 choice (gumbel on confident nodes) failed this by ~0.05 at scale 3."""
    p, q = _logit_pairs(600, 16, scale, seed=int(scale * 10))
    _assert_auto_not_below_branches(p, q, (1, 2, 3, 4), 200, f"random pairs scale {scale}")


def test_auto_is_never_below_its_branches_on_the_micro_world(micro_world) -> None:
    """The same on real LM pairs: the micro world's target and draft at held-out positions, T = 1 and 0.6."""
    from resispec.analysis.headroom import collect_logits, node_pairs, token_windows
    from resispec.models import stdlib_splits
    from tests.fixtures_world import micro_models

    world, paths = micro_world
    tok, target, draft = micro_models(paths)
    wins = token_windows(tok, stdlib_splits(world)["test"], 8, 96, 16)
    with torch.no_grad():
        lt, ld = collect_logits(target, draft, wins, 20, 16, seed=0)
    for temperature in (1.0, 0.6):
        p, q = node_pairs(lt, ld, temperature)
        _assert_auto_not_below_branches(p, q, (1, 2, 3, 4), 100, f"micro world T = {temperature}")


def test_calibration_cannot_produce_a_policy_below_a_branch() -> None:
    """calibrate_policy searches thresholds that include 'never distinct' (1.01) and 'always distinct' (0.0) for
    every candidate, so on its own calibration data the chosen policy's mean α is >= every pure branch's, for
    every n, whatever the per-node values; and at n = 1 it is the i.i.d. rule's exactly."""
    from resispec.analysis.headroom import auto_alpha, calibrate_policy

    gen = torch.Generator().manual_seed(3)
    draws = [1, 2, 3, 4]
    for trial in range(20):
        results = {}
        for t in (1.0, 0.6):
            for n in draws:
                per_node = {
                    name: {"alpha": torch.rand(50, generator=gen, dtype=torch.float64), "se": torch.zeros(50)}
                    for name in ("resispec", "gumbel", "rsd")
                }
                results[(t, n)] = {"per_node": per_node, "feature": torch.rand(50, generator=gen)}
        policy = calibrate_policy(results, draws, candidates=("gumbel", "rsd"))
        for n in draws:
            keys = [k for k in results if k[1] == n]

            def total(threshold, rule, keys=keys, n=n, results=results):
                return sum(
                    float(
                        auto_alpha(
                            results[k]["per_node"], results[k]["feature"], threshold, rule, "resispec", n
                        )[0].mean()
                    )
                    for k in keys
                )

            chosen = total(policy.threshold_for(n), policy.distinct_rule_for(n))
            pure = [total(1.01, "gumbel")] + [total(0.0, r) for r in ("gumbel", "rsd")]
            assert chosen >= max(pure) - 1e-12, (trial, n, chosen, pure)
            if n == 1:
                assert chosen == pytest.approx(pure[0], abs=1e-12)


def test_auto_on_a_chain_decodes_what_resispec_decodes() -> None:
    """On a chain every node has one draw, so resispec_auto is resispec's step there: the same seeded decode gives
    the same tokens and the same tau (the tiny world's bench had auto 12% below every other rule on a chain)."""
    from resispec.decoding import SpeculativeDecoder
    from tests.unit.test_decoding_helpers import micro_llama, noisy_copy

    target = micro_llama(32, 1, 16, seed=0, scale=8.0, attention_gain=(8.0, 4.0))
    draft = noisy_copy(target, 0.6, seed=1)
    outs = {}
    for rule in ("resispec", "resispec_auto", "chain"):
        dec = SpeculativeDecoder(target, draft, rule=rule, tree=[1, 1, 1, 1])
        gen = torch.Generator().manual_seed(5)
        out = dec.generate(
            torch.tensor([[3, 5]]), max_new_tokens=40, eos_token_id=[], generator=gen, temperature=1.0
        )
        outs[rule] = (out.sequences, out.stats.tau)
    assert torch.equal(outs["resispec_auto"][0], outs["resispec"][0])
    assert outs["resispec_auto"][1] == outs["resispec"][1] == outs["chain"][1]
