"""resispec.verify: edge cases, orderings between rules, n = 1, gradients, registry, fast paths."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from resispec.verify import (
    VERIFIERS,
    Proposal,
    capped_mass,
    optimal_acceptance,
    register,
    solve_kseq_rho,
    solve_resispec_T,
)
from resispec.verify.base import SCHEMES, covers
from resispec.verify.ratio import RatioProfile, sort_by_ratio

NUM_EDGE = 10_000
REDUCE_TO_CHAIN = [
    "chain",
    "rrs",
    "kseq",
    "resispec",
    "hub",
    "rsd",
]  # sampled-draft rules; gumbel is a coupling


def random_pairs(num: int, vocab: int, seed: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Peaked targets and correlated drafts, with some exact zeros in both. [num, vocab]."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(num, vocab, generator=gen, dtype=dtype)
    p = torch.softmax(2 * z, -1)
    q = torch.softmax(2 * z + torch.randn(num, vocab, generator=gen, dtype=dtype), -1)
    p = torch.where(torch.rand(num, vocab, generator=gen, dtype=dtype) < 0.1, 0, p)
    q = torch.where(torch.rand(num, vocab, generator=gen, dtype=dtype) < 0.1, 0, q)
    p[:, 0] += 1e-3  # keep every row non-empty
    q[:, 1] += 1e-3
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def closed_form(name: str, p: torch.Tensor, q: torch.Tensor, n: int) -> torch.Tensor | None:
    """The rule's closed-form acceptance at this n, or None where it declares none (closed_form_draws)."""
    rule = VERIFIERS[name]
    return rule.acceptance(p, q, n) if covers(rule.closed_form_draws, n) else None


def one_hot_argmax(p: torch.Tensor) -> torch.Tensor:
    """The temperature-0 target: one-hot at the first argmax of each row (what greedy_only rules are exact for)."""
    return torch.zeros_like(p).scatter_(-1, p.argmax(-1, keepdim=True), 1.0)


def _edge_pairs() -> dict[str, tuple[list[float], list[float], int]]:
    return {
        "q0_where_p_pos": ([0.5, 0.3, 0.2, 0.0], [0.0, 0.6, 0.4, 0.0], 3),
        "p0_where_q_pos": ([0.7, 0.0, 0.3, 0.0], [0.4, 0.3, 0.2, 0.1], 3),
        "p_equals_q": ([0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], 3),
        "onehot_p": ([0.0, 1.0, 0.0, 0.0], [0.5, 0.2, 0.2, 0.1], 2),
        "onehot_q": ([0.5, 0.2, 0.2, 0.1], [0.0, 0.0, 1.0, 0.0], 3),
        "n_equals_1": ([0.5, 0.2, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], 1),
        "n_beyond_support": ([0.3, 0.3, 0.2, 0.2], [0.6, 0.0, 0.4, 0.0], 4),
        "n_beyond_vocab": ([0.6, 0.4], [0.5, 0.5], 5),
    }


@pytest.mark.parametrize("case", sorted(_edge_pairs()))
@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_edge_cases_exact(name, case):
    """Every rule on every edge case: never emits p = 0 tokens, TV within the derived bound of
    test_verify_sampling (delta = 1e-6), acceptance within 4 SE of its closed form, valid draws."""
    p_row, q_row, n = _edge_pairs()[case]
    rule = VERIFIERS[name]
    p = torch.tensor([p_row], dtype=torch.float64).expand(NUM_EDGE, -1).contiguous()
    if rule.greedy_only:  # `greedy` is exact for temperature-0 (one-hot) targets only
        p = one_hot_argmax(p)
    q = torch.tensor([q_row], dtype=torch.float64).expand(NUM_EDGE, -1).contiguous()
    gen = torch.Generator().manual_seed(5)
    proposal = rule.propose(q, n, gen)
    tokens = proposal.token_ids
    assert tokens.shape == (NUM_EDGE, n)
    drawn = tokens[tokens >= 0]
    if rule.scheme != "deterministic" and name != "hub":  # sampled draws come from q's support
        assert (q[0, drawn] > 0).all()
    if rule.scheme == "distinct":  # no repeats among the non-empty slots
        srt = tokens.sort(-1).values
        assert not ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()
    token, slot = rule.verify(p, proposal, gen)
    assert (p[0, token] > 0).all(), "emitted a token with p = 0"
    hist = torch.bincount(token, minlength=p.shape[1]).double() / NUM_EDGE
    bound = 0.5 * torch.sqrt(p[0] * (1 - p[0]) / NUM_EDGE).sum() + math.sqrt(math.log(1e6) / (2 * NUM_EDGE))
    assert 0.5 * (hist - p[0]).abs().sum() <= bound
    alpha = closed_form(name, p[:1], q[:1], n)
    if alpha is not None:
        alpha = alpha.item()
        se = math.sqrt(max(alpha * (1 - alpha), 1 / NUM_EDGE) / NUM_EDGE)
        assert abs((slot >= 0).double().mean().item() - alpha) <= 4 * se, (alpha, (slot >= 0).double().mean())


def test_edge_case_values():
    """Exact values where they are known by hand."""
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    for name in ("chain", "rrs", "kseq", "resispec", "hub"):  # p = q: everything accepted
        assert VERIFIERS[name].acceptance(p, p, 3).item() == pytest.approx(1, abs=1e-12)
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)  # one-hot q: i.i.d. draws all equal
    for name in ("chain", "rrs", "kseq", "resispec"):
        assert VERIFIERS[name].acceptance(p, q, 3).item() == pytest.approx(0.2, abs=1e-12)
    gen = torch.Generator().manual_seed(0)
    props = VERIFIERS["rsd"].propose(q.expand(8, -1), 3, gen)  # distinct draws stop at q's support
    assert (props.token_ids[:, 0] == 2).all() and (props.token_ids[:, 1:] == -1).all()
    chain = VERIFIERS["chain"].propose(p.expand(8, -1), 4, gen)  # chain: one draw, other slots empty
    assert (chain.token_ids[:, 1:] == -1).all() and (chain.token_ids[:, 0] >= 0).all()


def test_invalid_inputs_raise():
    p = torch.tensor([[0.5, 0.5]])
    for rule in VERIFIERS.values():
        with pytest.raises(ValueError):
            rule.propose(p, 0)
        with pytest.raises(ValueError):
            rule.verify(torch.tensor([[0.2, 0.3, 0.5]]), rule.propose(p, 2), None)
    with pytest.raises(ValueError):
        VERIFIERS["rrs"].acceptance(p, torch.tensor([[0.5, 0.5]], dtype=torch.float64), 2)
    with pytest.raises(ValueError):
        optimal_acceptance(p, p, 2, scheme="nope")
    with pytest.raises(ValueError):
        optimal_acceptance(torch.full((1, 13), 1 / 13), torch.full((1, 13), 1 / 13), 2, scheme="wor")


# ---------------------------------------------------------------------------------------------- properties


def test_rule_ordering_on_random_pairs():
    """rrs <= kseq <= resispec <= alpha*_iid; alpha*_iid and the distinct rules <= 1; all >= chain."""
    for n in (2, 3, 5, 8):
        p, q = random_pairs(64, 40, seed=n)
        a = {name: VERIFIERS[name].acceptance(p, q, n) for name in ("chain", "rrs", "kseq", "resispec")}
        opt = optimal_acceptance(p, q, n, "iid")
        tol = 1e-9
        assert (a["chain"] <= a["rrs"] + tol).all()
        assert (a["rrs"] <= a["kseq"] + tol).all()
        assert (a["kseq"] <= a["resispec"] + tol).all()
        assert (a["resispec"] <= opt + tol).all()
        assert (opt <= 1 + tol).all()
        assert (a["resispec"] > a["rrs"] + 1e-4).any()  # the ordering is not vacuous


def test_n1_reduces_to_chain():
    p, q = random_pairs(32, 30, seed=11)
    chain = torch.minimum(p, q).sum(-1)
    for name in REDUCE_TO_CHAIN:
        got = closed_form(name, p, q, 1)
        if got is not None:
            torch.testing.assert_close(got, chain, rtol=0, atol=1e-12)
    torch.testing.assert_close(optimal_acceptance(p, q, 1), chain, rtol=0, atol=1e-12)
    # rsd has no closed form: sample it at n = 1 on one pair
    num = 40_000
    pr, qr = p[:1].expand(num, -1).contiguous(), q[:1].expand(num, -1).contiguous()
    gen = torch.Generator().manual_seed(3)
    _, slot = VERIFIERS["rsd"].verify(pr, VERIFIERS["rsd"].propose(qr, 1, gen), gen)
    alpha = chain[0].item()
    assert abs((slot >= 0).double().mean().item() - alpha) <= 4 * math.sqrt(alpha * (1 - alpha) / num)


@pytest.mark.parametrize("name", ["rrs", "kseq", "resispec"])
def test_one_draw_verifies_exactly_as_chain(name):
    """At n = 1 these rules take the chain plan without solving T* / rho* (the decoder's single-draft depths):
    same proposal, same generator state -> the same tokens and slots as chain, draw for draw."""
    p, q = random_pairs(256, 40, seed=12)
    prop = VERIFIERS["chain"].propose(q, 1, torch.Generator().manual_seed(5))
    want = VERIFIERS["chain"].verify(p, prop, torch.Generator().manual_seed(6))
    got = VERIFIERS[name].verify(p, prop, torch.Generator().manual_seed(6))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_resispec_verify_solve_precision():
    """verify() solves T* to verify_halvings (fewer than acceptance() uses): within (n - 1) 2^-h of T*."""
    from resispec.verify.iid import ResiSpecRule

    p, q = random_pairs(64, 200, seed=13)
    for n in (2, 4):
        exact = solve_resispec_T(p, q, n)
        coarse = solve_resispec_T(p, q, n, steps=ResiSpecRule.verify_halvings)
        assert ((coarse - exact) >= -1e-12).all()  # the upper end of the bracket: g(T) >= 0
        assert ((coarse - exact) <= (n - 1) * 2.0**-ResiSpecRule.verify_halvings).all()


@pytest.mark.parametrize("dtype,vocab", [(torch.float64, 300), (torch.float32, 300), (torch.float32, 8192)])
def test_host_profile_matches_the_torch_profile(dtype, vocab):
    """One row on CPU runs the solvers and the shaped plan on numpy (HostRatioProfile, what acceptance() builds for
    one row): F, T*, rho* and the plan's masses equal the torch profile's. Rows with q = 0 and p = 0 entries;
    float32 at large V takes the packed-key sort."""
    from resispec.verify.iid import ResiSpecRule, shaped_plan
    from resispec.verify.ratio import HostRatioProfile, build_profile

    p_all, q_all = random_pairs(6, vocab, seed=15, dtype=dtype)
    t = torch.tensor([[0.0, 0.5, 1.0, 1.7, 3.0, 9.0]], dtype=torch.float64)
    assert isinstance(build_profile(p_all, q_all), RatioProfile)  # a batch
    for row in range(p_all.shape[0]):
        p, q = p_all[row : row + 1], q_all[row : row + 1]
        host, ref = build_profile(p, q), RatioProfile.build(p, q)
        assert isinstance(host, HostRatioProfile)
        assert isinstance(build_profile(p.bfloat16(), q.bfloat16()), RatioProfile)  # numpy has no bfloat16
        torch.testing.assert_close(
            torch.from_numpy(host.capped_mass(t.numpy())), ref.capped_mass(t), rtol=0, atol=1e-12
        )
        torch.testing.assert_close(
            torch.from_numpy(host.capped_mass(t[0, 2:3].numpy())), ref.capped_mass(t[0, 2:3])
        )
        for n in (2, 3, 4, 8):
            for solver, steps in (
                (solve_resispec_T, ResiSpecRule.verify_halvings),
                (solve_resispec_T, None),
                (solve_kseq_rho, None),
            ):
                got, want = solver(p, q, n, host, steps=steps), solver(p, q, n, ref, steps=steps)
                assert got.dtype == want.dtype == dtype
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)
            t_star = solve_resispec_T(p, q, n, ref, steps=ResiSpecRule.verify_halvings)
            plan_h, plan_t = shaped_plan(p, q, n, t_star, host), shaped_plan(p, q, n, t_star, ref)
            for name in ("mu", "lo", "hi", "bottom", "top"):
                torch.testing.assert_close(getattr(plan_h, name), getattr(plan_t, name), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype,vocab", [(torch.float64, 300), (torch.float32, 300), (torch.float32, 8192)])
def test_host_histogram_matches_the_torch_histogram(dtype, vocab):
    """One row on CPU (the decoder's verify calls) locates T* and rho* on a numpy histogram (HostHistogramProfile)
    and builds the plan on numpy masses (HostDirectMass): F equals the torch histogram's at the same bins, and the
    masses DirectMass's; the T it locates at the default bins is within a few bin widths of the sorted profile's
    T*; resispec's and kseq's verified tokens equal, draw for draw, the torch path's on the same T and rho."""
    from resispec.verify.iid import ResiSpecRule, scaled_plan, shaped_plan, verify_sequential
    from resispec.verify.ratio import (
        DirectMass,
        HistogramProfile,
        HostDirectMass,
        HostHistogramProfile,
        direct_mass,
        histogram_profile,
    )

    p_all, q_all = random_pairs(6, vocab, seed=16, dtype=dtype)
    assert isinstance(histogram_profile(p_all, q_all, 4.0), HistogramProfile)  # a batch
    assert isinstance(direct_mass(p_all, q_all), DirectMass)
    tol = dict(rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)
    for row in range(p_all.shape[0]):
        p, q = p_all[row : row + 1], q_all[row : row + 1]
        assert isinstance(histogram_profile(p, q, 4.0), HostHistogramProfile)
        assert isinstance(direct_mass(p, q), HostDirectMass)
        assert isinstance(histogram_profile(p.bfloat16(), q.bfloat16(), 4.0), HistogramProfile)
        for n in (2, 4):
            bins = min(vocab, 4096)  # the torch profile caps its bins at V
            host, ref = (
                HostHistogramProfile.build(p, q, float(n), bins),
                HistogramProfile.build(p, q, float(n), bins),
            )
            t = torch.linspace(0, n, 37, dtype=torch.float64)[None]  # edges and points between them
            torch.testing.assert_close(
                torch.from_numpy(host.capped_mass(t.numpy())), ref.capped_mass(t), **tol
            )
            exact = DirectMass.build(p, q)
            for t1 in (0.0, 0.3, 1.0, 2.5):
                t1 = torch.tensor([t1], dtype=torch.float64)
                got = torch.from_numpy(HostDirectMass.build(p, q).capped_mass(t1.numpy()))
                torch.testing.assert_close(got, exact.capped_mass(t1), rtol=0, atol=1e-12)
            fine = histogram_profile(p, q, float(n))  # the default bins, what verify() builds
            # its solves bisect on Python floats (scalar_capped_mass); the array solvers on the same F agree
            arrays = SimpleNamespace(capped_mass=fine.capped_mass, total=fine.total)
            for solver, steps in ((solve_resispec_T, ResiSpecRule.verify_halvings), (solve_kseq_rho, None)):
                bracket = (n - 1) * 2.0 ** -(steps or 26)
                got, want = solver(p, q, n, fine, steps=steps), solver(p, q, n, arrays, steps=steps)
                assert (got - want).abs().item() <= bracket * 1.001, solver.__name__
            edges_t = [0.0, 0.37, 1.0, 2.5, float(n), n + 1.0]
            scalar = fine.scalar_capped_mass()
            assert [scalar(x) for x in edges_t] == pytest.approx(
                fine.capped_mass(np.array(edges_t)).tolist(), rel=0, abs=1e-12
            )
            t_hist = solve_resispec_T(p, q, n, fine, steps=ResiSpecRule.verify_halvings)
            rho = solve_kseq_rho(p, q, n, fine)
            plans = {
                "resispec": shaped_plan(p, q, n, t_hist, DirectMass.build(p, q)),
                "kseq": scaled_plan(p, q, n, rho),
            }
            for name, plan in plans.items():
                # the plan's acceptance 1 - mu_{n+1} is the rule's optimum: a T or rho located on 1024 bins loses
                # nothing measurable (the acceptance is flat at the optimum)
                residual = (p - plan.used_mass(p, q) - plan.mu[:, -1:] * q).clamp_min(0)
                optimum = VERIFIERS[name].acceptance(p.double(), q.double(), n)
                assert (optimum - (p.sum() - residual.sum()).double()).abs().item() <= tol["atol"] + 1e-4, (
                    name
                )
            for name, plan in plans.items():
                proposal = VERIFIERS[name].propose(q, n, torch.Generator().manual_seed(row))
                for seed in range(20):
                    gen_got, gen_want = (
                        torch.Generator().manual_seed(seed),
                        torch.Generator().manual_seed(seed),
                    )
                    got = VERIFIERS[name].verify(p, proposal, gen_got)
                    want = verify_sequential(p, proposal, plan, gen_want)
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (name, n, seed)


@pytest.mark.parametrize("dtype,vocab", [(torch.float64, 300), (torch.float32, 8192)])
def test_sequential_tests_on_numpy_are_bitwise_the_torch_ones(dtype, vocab):
    """verify_sequential runs one CPU row's accept tests on numpy (iid._accept_tests on arrays): for every plan kind
    (rrs's greedy windows, resispec's shaped windows, kseq's scaled caps), draws with repeats and empty (-1)
    slots, the accepted flags, the first accepting draw and the residual are bitwise the torch computation's."""
    from resispec.verify.iid import _accept_tests, greedy_plan, host_plan, scaled_plan, shaped_plan
    from resispec.verify.ratio import direct_mass

    p_all, q_all = random_pairs(8, vocab, seed=18, dtype=dtype)
    gen = torch.Generator().manual_seed(18)
    for row in range(p_all.shape[0]):
        p, q = p_all[row : row + 1], q_all[row : row + 1]
        for n in (2, 3, 4):
            t = solve_resispec_T(p, q, n)
            plans = [
                greedy_plan(p, q, n),
                shaped_plan(p, q, n, t, direct_mass(p, q)),
                scaled_plan(p, q, n, solve_kseq_rho(p, q, n)),
            ]
            tokens = VERIFIERS["rrs"].propose(q, n, gen).token_ids
            if row % 3 == 1:
                tokens[:, -1] = tokens[:, 0]  # a repeated draw
            if row % 3 == 2:
                tokens[:, -1] = -1  # an empty slot
            u = torch.rand(tokens.shape, generator=gen, dtype=dtype)
            for plan in plans:
                want = _accept_tests(p, tokens, q, u, plan)
                got = _accept_tests(p.numpy(), tokens.numpy(), q.numpy(), u.numpy(), host_plan(plan))
                assert torch.equal(torch.from_numpy(got[0]), want[0])
                assert torch.equal(torch.from_numpy(got[1]), want[1])
                assert torch.equal(torch.from_numpy(got[2]()), want[2]())


def test_sample_rejected_skips_the_residual_but_not_its_uniforms():
    """base.sample_rejected: where every row accepted (on CPU) the residual is never built, yet the generator
    advances exactly as the full rejection sample's, so every later draw of the step is unchanged; where a row
    rejected it IS sample_weights; uniforms passed in are never redrawn."""
    from resispec.verify.base import sample_rejected, sample_weights

    p, q = random_pairs(3, 50, seed=17, dtype=torch.float32)
    built = []

    def residual():
        built.append(1)
        return (p - 0.5 * q).clamp_min(0)

    for accepted in (torch.tensor([True, True, True]), torch.tensor([True, False, True])):
        gen_got, gen_want = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        got = sample_rejected(accepted, residual, gen_got, p)
        want = sample_weights(residual(), gen_want, p)
        assert torch.equal(torch.rand(4, generator=gen_got), torch.rand(4, generator=gen_want))
        if accepted.all():
            assert len(built) == 1 and (got == -1).all()  # only the reference built it
        else:
            assert torch.equal(got, want)
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    u = torch.rand(3, 1)
    sample_rejected(torch.tensor([True] * 3), residual, gen, p, u)
    assert torch.equal(gen.get_state(), state)


def test_histogram_profile_is_exact_at_bin_edges_and_locates_T():
    """HistogramProfile: F exact at bin edges (and within width x bin mass between them); the plan on the T it
    locates (default bins, verify()'s halvings) accepts what the closed form says; DirectMass is F itself."""
    from resispec.verify.iid import ResiSpecRule, shaped_plan
    from resispec.verify.ratio import DirectMass, HistogramProfile

    p, q = random_pairs(8, 300, seed=14)
    p[:, :5], q[:, 5:8] = 0.0, 0.0  # q = 0 and p = 0 entries
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    n, bins = 4, 64
    hist = HistogramProfile.build(p, q, float(n), bins)
    edges = torch.arange(0, bins + 1, dtype=torch.float64)[None].expand(8, -1) * (n / bins)
    want = torch.stack([torch.minimum(p, e * q).sum(-1) for e in edges[0]], -1)
    torch.testing.assert_close(hist.capped_mass(edges), want, rtol=0, atol=1e-12)
    t = torch.rand(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * n
    mid = torch.stack([torch.minimum(p, t[:, k : k + 1] * q).sum(-1) for k in range(5)], -1)
    assert ((hist.capped_mass(t) - mid).abs() <= n / bins + 1e-12).all()
    torch.testing.assert_close(DirectMass.build(p, q).capped_mass(t[:, 0]), mid[:, 0], rtol=0, atol=1e-12)
    fine = HistogramProfile.build(p, q, float(n))  # the default bins
    t_hist = solve_resispec_T(p, q, n, fine, steps=ResiSpecRule.verify_halvings)
    plan = shaped_plan(p, q, n, t_hist, DirectMass.build(p, q))
    residual = (p - plan.used_mass(p, q) - plan.mu[:, -1:] * q).clamp_min(0)
    want = VERIFIERS["resispec"].acceptance(p, q, n)
    assert ((p.sum(-1) - residual.sum(-1) - want).abs() <= 1e-4).all()


def test_float32_and_float64_agree():
    p, q = random_pairs(16, 50, seed=2)
    for name in ("rrs", "kseq", "resispec", "hub", "onehot"):
        a64 = VERIFIERS[name].acceptance(p, q, 4)
        a32 = VERIFIERS[name].acceptance(p.float(), q.float(), 4)
        assert a32.dtype == torch.float32
        torch.testing.assert_close(a32.double(), a64, rtol=0, atol=2e-5)


def test_profile_fast_sort_matches_torch_sort():
    """The numpy packed-key sort (float32 CPU, large V) gives the same ratio profile as torch.sort."""
    p, q = random_pairs(4, 8192, seed=4, dtype=torch.float32)
    w_fast, p_fast, q_fast = sort_by_ratio(p, q)
    w_ref = torch.sort(torch.where(q > 0, p / q, torch.full_like(p, float("inf"))), -1).values
    torch.testing.assert_close(w_fast, w_ref, rtol=0, atol=0)
    assert torch.equal(q_fast.sort(-1).values, q.sort(-1).values)
    t = torch.tensor([[0.3, 1.0, 2.5]]).expand(4, -1).double()
    f = RatioProfile.build(p, q).capped_mass(t)
    want = torch.stack([torch.minimum(p, x * q).double().sum(-1) for x in (0.3, 1.0, 2.5)], -1)
    torch.testing.assert_close(f, want, rtol=0, atol=1e-5)


def test_resispec_exact_for_any_T():
    """The run-time guard: with a deliberately wrong T the rule is still exact (only acceptance drops)."""
    from resispec.verify.iid import shaped_plan, verify_sequential

    p1, q1 = random_pairs(1, 6, seed=9)
    num, n = 60_000, 3
    p, q = p1.expand(num, -1).contiguous(), q1.expand(num, -1).contiguous()
    gen = torch.Generator().manual_seed(8)
    profile = RatioProfile.build(p, q)
    for t in (1.0, 1.7, float(n)):
        plan = shaped_plan(p, q, n, torch.full((num,), t, dtype=p.dtype), profile)
        token, slot = verify_sequential(
            p, Proposal(token_ids=torch.multinomial(q, n, True, generator=gen), q=q), plan, gen
        )
        hist = torch.bincount(token, minlength=p.shape[1]).double() / num
        bound = 0.5 * torch.sqrt(p1 * (1 - p1) / num).sum() + math.sqrt(math.log(1e6) / (2 * num))
        assert 0.5 * (hist - p1[0]).abs().sum() <= bound, t
    assert (solve_resispec_T(p1, q1, n) > 1).all()


# ---------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", ["chain", "rrs", "kseq", "resispec", "hub"])
def test_acceptance_gradients(name):
    """Finite gradients w.r.t. q's logits (also where q = 0 or p = 0), equal to finite differences with the
    solver constants (T*, rho*, top set) held fixed, and an ascent step increases alpha."""
    n = 3
    p, q0 = random_pairs(6, 12, seed=21)
    logits = torch.log(q0).clamp_min(-30)  # q = 0 -> tiny but the gradient path through softmax stays finite
    logits[:, 5] = float("-inf")  # an exact zero in q
    rule = VERIFIERS[name]
    z = logits.clone().requires_grad_(True)
    alpha = rule.acceptance(p, torch.softmax(z, -1), n)
    (grad,) = torch.autograd.grad(alpha.sum(), z)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0

    if name in ("kseq", "resispec"):  # hold T* / rho* fixed for the finite differences
        solver = solve_resispec_T if name == "resispec" else solve_kseq_rho
        t = solver(p, torch.softmax(logits, -1), n)

        def fixed(zz):
            return capped_mass(p, torch.softmax(zz, -1), t)
    else:

        def fixed(zz):
            return rule.acceptance(p, torch.softmax(zz, -1), n)

    eps = 1e-6
    for row, col in [(0, 0), (1, 3), (2, 7), (3, 5), (4, 1)]:
        dz = torch.zeros_like(logits)
        dz[row, col] = eps
        if not math.isfinite(logits[row, col].item()):
            assert grad[row, col] == 0
            continue
        fd = (fixed(logits + dz) - fixed(logits - dz))[row].item() / (2 * eps)
        assert fd == pytest.approx(grad[row, col].item(), abs=1e-5)

    step = logits + 0.05 * grad.nan_to_num(0) / grad.abs().max()
    assert (rule.acceptance(p, torch.softmax(step, -1), n) >= alpha.detach() - 1e-12).all()
    assert (rule.acceptance(p, torch.softmax(step, -1), n) > alpha.detach()).any()


def test_acceptance_grad_wrt_p_is_finite():
    p, q = random_pairs(4, 10, seed=5)
    for name in ("chain", "rrs", "kseq", "resispec", "hub", "onehot"):
        pp = p.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(VERIFIERS[name].acceptance(pp, q, 3).sum(), pp)
        assert torch.isfinite(g).all()


# ---------------------------------------------------------------------------------------------- registry


def test_registry_and_protocol():
    for key, rule in VERIFIERS.items():
        assert rule.name == key and rule.scheme in SCHEMES
    for name in ("chain", "onehot", "rrs", "rsd", "kseq", "hub", "gumbel", "resispec"):
        assert name in VERIFIERS
    with pytest.raises(ValueError):
        register(type(VERIFIERS["rrs"])())  # a second object under a taken name
    with pytest.raises(ValueError):
        register(object())


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_cuda_matches_contract(name):
    """Same code on CUDA: exact on one pair (TV bound) with a CUDA generator."""
    p1, q1 = random_pairs(1, 1000, seed=6, dtype=torch.float32)
    p1 = one_hot_argmax(p1) if VERIFIERS[name].greedy_only else p1  # `greedy` is exact for one-hot targets only
    num = 50_000
    p = p1.cuda().expand(num, -1).contiguous()
    q = q1.cuda().expand(num, -1).contiguous()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rule = VERIFIERS[name]
    token, slot = rule.verify(p, rule.propose(q, 4, gen), gen)
    hist = torch.bincount(token, minlength=p.shape[1]).double().cpu() / num
    pd = p1[0].double()
    bound = 0.5 * torch.sqrt(pd * (1 - pd) / num).sum() + math.sqrt(math.log(1e6) / (2 * num))
    assert 0.5 * (hist - pd).abs().sum() <= bound
    alpha = closed_form(name, p1.cuda(), q1.cuda(), 4)
    if alpha is not None:
        alpha = alpha.item()
        se = math.sqrt(max(alpha * (1 - alpha), 1 / num) / num)
        assert abs((slot >= 0).double().mean().item() - alpha) <= 4 * se
