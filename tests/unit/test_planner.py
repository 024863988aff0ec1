"""The tree planner (resispec/decoding/planner/) and decode.tree=auto.

The model is checked on costs and acceptances we choose, where the best tree is known by hand: a flat-cost
device (a GPU: the target costs the same for 1 or 32 nodes) with good acceptance wants a wide tree, a device whose
target cost grows with every node wants a chain, and an expensive multi-draw verification pushes toward a chain.
Then the measuring parts run on micro Llamas: calibration, verification cost, and the whole Planner.choose.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from resispec.decoding import SpeculativeDecoder
from resispec.decoding.config import DEFAULT_TREE, DecodeConfig
from resispec.decoding.planner import (
    ALPHA_PROMPTS,
    BATCH_NODE_GRID,
    BATCH_SETTLE_MOST,
    BATCH_SETTLE_ROUNDS,
    BATCH_SETTLE_STEPS,
    FINALISTS,
    NODE_GRID,
    REMEASURE_PASSES,
    SETTLE_MOST,
    SETTLE_PROMPTS,
    SETTLE_TOKENS,
    TIE_MARGIN,
    TIE_Z,
    CostModel,
    Decoded,
    ForwardProbe,
    Plan,
    Planner,
    calibrate_alpha,
    candidate_trees,
    expected_tau,
    greedy_hits,
    greedy_tau,
    greedy_walk,
    measure_batch_overhead,
    measure_verify_ms,
    measure_verify_row_ms,
    monotone,
    node_logits,
    pick_measured,
    plan_tree,
    rank_trees,
    sampled_alpha,
    settle_by_decoding,
    settle_candidates,
    teacher_forced_top,
    tie_margin,
)
from resispec.decoding.tree import max_tree_nodes
from resispec.errors import UserError
from resispec.verify import build_rule
from tests.unit.test_decoding_helpers import micro_llama, noisy_copy, single_thread

NODES = (1, 2, 4, 8, 16, 32)


def _costs(target_per_node: float, draft_ms: float = 0.5, verify_ms: dict | None = None) -> CostModel:
    """Target: 10 ms + target_per_node ms per extra token; the draft flat."""
    return CostModel(
        target_ms={n: 10.0 + target_per_node * (n - 1) for n in NODES},
        draft_ms={n: draft_ms for n in NODES},
        verify_ms=verify_ms or {},
    )


# an acceptance profile where more draws clearly help (the shape ResiSpec has on the tiny world at T = 1)
ALPHA = {1: 0.6, 2: 0.75, 3: 0.82, 4: 0.86}


def test_expected_tau_by_hand():
    assert expected_tau([1, 1], {1: 0.5}) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tau([2, 1], {1: 0.5, 2: 0.8}) == pytest.approx(1 + 0.8 + 0.8 * 0.5)


def test_candidates_are_non_increasing_bounded_and_include_chains():
    cands = candidate_trees(max_nodes=32, max_depth=6, max_branch=4)
    assert all(max_tree_nodes(t) <= 32 for t in cands)
    assert all(a >= b for t in cands for a, b in zip(t, t[1:], strict=False))
    for depth in range(1, 7):
        assert [1] * depth in cands
    assert [4, 2, 1, 1] in cands
    assert len({tuple(t) for t in cands}) == len(cands)


def test_cost_model_interpolates_and_extrapolates():
    cost = CostModel(target_ms={1: 10.0, 4: 16.0}, draft_ms={1: 1.0})
    assert cost.target(1) == 10.0
    assert cost.target(2) == pytest.approx(12.0)
    assert cost.target(8) == pytest.approx(32.0)  # beyond the grid: linear in tokens
    # [2, 1]: the draft feeds 1 token, then the 2 nodes of depth 1 (linear beyond its grid: 2 ms); the target
    # sees the root + 2 + 2 nodes (5 tokens: 16 * 5 / 4 ms)
    assert cost.step_ms([2, 1]) == pytest.approx(1.0 + 2.0 + 20.0)


def test_cost_tables_are_made_monotone():
    """A noisy slow single-token measurement must not make AR look slower than a 5-token step."""
    assert monotone({1: 14.0, 2: 11.0, 4: 12.0, 8: 11.5, 16: 15.0}) == {
        1: 11.0,
        2: 11.0,
        4: 11.5,
        8: 11.5,
        16: 15.0,
    }


def test_flat_cost_device_gets_a_wide_tree():
    plan = plan_tree(_costs(target_per_node=0.0), ALPHA)
    assert max(plan.tree) > 1 and max_tree_nodes(plan.tree) > len(plan.tree)
    assert plan.tau == pytest.approx(expected_tau(plan.tree, ALPHA))
    assert plan.speedup == pytest.approx(plan.tokens_per_s / (1e3 / 10.0))
    assert plan.alpha == ALPHA


def test_node_cost_device_gets_a_chain():
    """Every extra node costs as much as a whole AR step: only a chain can pay, and the planner must find it."""
    plan = plan_tree(_costs(target_per_node=3.0), ALPHA)
    assert plan.tree == [1] * len(plan.tree)


def test_expensive_multi_draw_verification_pushes_to_a_chain():
    cheap = plan_tree(_costs(0.2), ALPHA)
    assert max(cheap.tree) > 1
    costly = plan_tree(_costs(0.2, verify_ms={1: 0.1, 2: 30.0, 3: 30.0, 4: 30.0}), ALPHA)
    assert costly.tree == [1] * len(costly.tree)


def test_verify_cost_weights_each_depth_by_its_reach():
    cost = _costs(0.0, verify_ms={1: 1.0, 2: 2.0})
    assert cost.verify_cost([2, 1, 1], {1: 0.5, 2: 0.8}) == pytest.approx(2.0 + 0.8 * 1.0 + 0.8 * 0.5 * 1.0)
    assert _costs(0.0).verify_cost([2, 1], {1: 0.5, 2: 0.8}) == 0.0


def test_verify_cost_charges_a_one_draw_run_as_one_call():
    """lean.chain_from verifies a run of one-draw nodes in one call when the walk reaches the run's first node."""
    cost = _costs(0.0, verify_ms={1: 1.0, 2: 2.0})
    cost.verify_row_ms = 0.25
    alpha = {1: 0.5, 2: 0.8}
    # [2, 1, 1]: the root's two draws, then depths 2 and 3 in one call of two rows
    assert cost.verify_cost([2, 1, 1], alpha) == pytest.approx(2.0 + 0.8 * (1.0 + 0.25))
    # a chain of four: one call of four rows at the root
    assert cost.verify_cost([1, 1, 1, 1], alpha) == pytest.approx(1.0 + 3 * 0.25)
    # [2, 1, 2]: depth 2 alone (its child draws twice), then depth 3's two draws
    assert cost.verify_cost([2, 1, 2], alpha) == pytest.approx(2.0 + 0.8 * 1.0 + 0.8 * 0.5 * 2.0)
    # the step's first call (the root's, always made) pays its extra once, by the root's draws
    cost.root_verify_extra_ms = {1: 0.0, 2: 0.3}
    assert cost.verify_cost([2, 1, 2], alpha) == pytest.approx(0.3 + 2.0 + 0.8 * 1.0 + 0.8 * 0.5 * 2.0)
    assert cost.verify_cost([1, 1, 1, 1], alpha) == pytest.approx(1.0 + 3 * 0.25)


def test_batched_chain_walks_are_measured_as_overhead():
    """At batch sizes > 1 the batched decoder verifies every row's chain at once (rules whose one draw is standard
    speculative sampling): the chain's walk is in the measured overhead, a branching tree's still per row."""
    from resispec.verify import build_rule

    cost = _costs(0.0, verify_ms={1: 1.0, 2: 2.0})
    cost.chain_walk_in_overhead = True
    alpha = {1: 0.5, 2: 0.8}
    assert cost.verify_cost([1, 1, 1], alpha) == 0.0 and cost.verify_cost([1], alpha) == 0.0
    assert cost.verify_cost([2, 1], alpha) == pytest.approx(2.0 + 0.8 * 1.0)
    assert all(build_rule(r).one_draw_is_standard for r in ("chain", "rrs", "kseq", "resispec"))
    assert not any(getattr(build_rule(r), "one_draw_is_standard", False) for r in ("rsd", "gumbel", "hub"))


def test_one_draw_run_cost_is_measured():
    ms = measure_verify_row_ms(build_rule("resispec"), vocab=512, reps=3)
    assert ms >= 0.0


def test_plan_never_beats_the_best_candidate_by_enumeration():
    cost = _costs(0.4, verify_ms={1: 0.3, 2: 0.9, 3: 1.2, 4: 1.6})
    plan = plan_tree(cost, ALPHA)
    best = max(
        1e3 * expected_tau(t, ALPHA) / (cost.step_ms(t) + cost.verify_cost(t, ALPHA))
        for t in candidate_trees(max_branch=4)
    )
    assert plan.tokens_per_s == pytest.approx(best)


def test_greedy_hits_by_hand():
    # 3 nodes, vocab 4: the target's argmax is 0 at every node; the draft ranks it 1st, 2nd, 1st
    t_logits = torch.tensor([[5.0, 0, 0, 0]] * 3)
    d_logits = torch.tensor([[4.0, 3, 2, 1], [3.0, 4, 2, 1], [4.0, 3, 2, 1]])
    assert greedy_hits(t_logits, d_logits, 2).tolist() == [[True, False, True], [True, True, True]]


def test_greedy_alpha_is_the_hit_rate():
    gen = torch.Generator().manual_seed(0)
    t_logits, d_logits = torch.randn(50, 16, generator=gen), torch.randn(50, 16, generator=gen)
    alpha = calibrate_alpha(None, None, [], "chain", {"temperature": 0.0}, 0, logits=(t_logits, d_logits))
    best = t_logits.argmax(-1, keepdim=True)
    for n in range(1, 5):
        top = d_logits.argsort(-1, descending=True)[:, :n]
        assert alpha[n] == pytest.approx(float((top == best).any(-1).double().mean()))


def test_greedy_walk_by_hand():
    """The decoder's temperature-0 step over a continuation of 6 tokens: level j of a step from token k accepts
    while token k + j - 1 is among the draft's top b_j, at most r - 1 levels with r tokens left, one token more."""
    hits = torch.tensor([[0, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # top 1, top 2
    assert greedy_walk([1], hits) == (4, 2)  # miss; 1 + bonus; miss; 1 + bonus
    assert greedy_walk([1, 1], hits) == (3, 3)  # miss; 2 + bonus; the last token: 1 level left, accepted
    assert greedy_walk([2, 1], hits) == (2, 4)  # the root's second-best catches tokens 0 and 3
    assert greedy_walk([1] * 7, torch.ones(2, 6, dtype=torch.bool)) == (1, 5)  # 5 drafts + the bonus: all 6
    assert greedy_tau([2, 1], [hits, hits]) == pytest.approx((8 + 4) / 4)
    assert greedy_tau([1], []) == 1.0


def test_greedy_tau_is_the_decoders_own_count(micro_world):
    """At temperature 0 the planner counts tau instead of multiplying it: each prompt's greedy continuation
    (decoded in one batch) is batch 1's, and walking the teacher-forced hits along it gives, for chains and trees
    alike, exactly the steps and accepted tokens the decoder's SETTLE_TOKENS-token decode of that prompt records
    (the settling decodes'; EOS ignored as there). On the micro world's trained pair (whose greedy text soon
    repeats one token, but whose draft hits it at some positions and not others)."""
    from resispec.analysis.headroom import token_windows
    from resispec.models import stdlib_splits
    from tests.fixtures_world import micro_models

    world, paths = micro_world
    tok, target, draft = micro_models(paths)
    prompts = [
        w[: 12 + 3 * i] for i, w in enumerate(token_windows(tok, stdlib_splits(world)["test"], 4, 64, 16))
    ]
    with single_thread():
        planner = Planner(target, prompts, continuation_tokens=4)
        hit_sets = planner._greedy_hit_sets(draft)
        ar = SpeculativeDecoder(target, target, rule="chain", tree=[1])
        for p, seq, hits in zip(prompts, planner._greedy_sequences()[0], hit_sets, strict=True):
            ids = torch.tensor([p])
            ref = ar.generate_autoregressive(
                ids, max_new_tokens=SETTLE_TOKENS, temperature=0.0, eos_token_id=[]
            )
            assert seq == ref.sequences[0].tolist() and hits.shape == (4, SETTLE_TOKENS)
            for tree in ([1], [1, 1, 1], [1] * 6, [2, 1], [3, 2, 1], [4, 2, 2, 1]):
                dec = SpeculativeDecoder(target, draft, rule="resispec", tree=tree)
                out = dec.generate(ids, max_new_tokens=SETTLE_TOKENS, temperature=0.0, eos_token_id=[])
                assert out.sequences[0].tolist() == seq
                assert (out.stats.num_drafts, out.stats.num_accepted_tokens) == greedy_walk(tree, hits), tree
    rates = torch.cat(hit_sets, dim=1).double().mean(-1)
    assert 0.1 < rates[0] < 0.9 and rates[3] > rates[0]  # the draft both hits and misses: a walk with content


def test_teacher_forced_top_pads_and_chunks_without_changing_a_position(micro_pair):
    """Sequences of different lengths and starts, two to a forward, right-padded and cut to the kept positions:
    each position's top ids are those of that sequence's own unpadded forward."""
    target, _ = micro_pair
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (7, 20, 12)]
    starts = [3, 15, 5]
    got = teacher_forced_top(target, seqs, starts, 3, 64, rows=2)
    best = teacher_forced_top(target, seqs, starts, 1, 64, rows=2)
    with torch.inference_mode():
        for seq, start, top, arg in zip(seqs, starts, got, best, strict=True):
            logits = target(input_ids=torch.tensor([seq])).logits[0, start - 1 : -1]
            assert top.shape == (len(seq) - start, 3) and torch.equal(top, logits.topk(3, dim=-1).indices)
            assert torch.equal(arg[:, 0], logits.argmax(-1))


def test_rank_trees_orders_every_candidate_and_plan_tree_is_its_first():
    cost = _costs(0.4, verify_ms={1: 0.3, 2: 0.9, 3: 1.2, 4: 1.6})
    ranked = rank_trees(cost, ALPHA)
    assert len(ranked) == len(candidate_trees(max_branch=4))
    assert [p.tokens_per_s for p in ranked] == sorted((p.tokens_per_s for p in ranked), reverse=True)
    assert ranked[0] == plan_tree(cost, ALPHA) and not ranked[0].measured


def _plan(tree, tps, tau=2.0):
    return Plan(list(tree), tau, 1e3 * tau / tps, tps, tps / 100.0, dict(ALPHA))


def _fake_decodes(tps: dict, calls: list | None = None, tau: dict | None = None):
    """A settle_by_decoding `decode`: each tree (None: AR) decodes 48 tokens at its planted tokens per second."""

    def decode(tree, rnd):
        key = None if tree is None else tuple(tree)
        if calls is not None:
            calls.append((key, rnd))
        steps = 48 if key is None else round(48 / (tau or {}).get(key, 2.0))
        return Decoded(48, steps, 48 - steps, 48 / tps[key])

    return decode


def test_settle_decodes_the_near_ties_the_best_chain_and_ar():
    """The plans predicted within the band (at most `most`) and the best-ranked chain, even ranked far outside it,
    are decoded, with AR, once a round in ABBA order, each round the same round index (prompt and seeds) for every
    candidate. The plan returned is the fastest measured, marked measured, with its tau and speedup as decoded and
    the model's figures kept; a plan outside the band is never decoded."""
    ranked = [_plan([2, 1, 1], 300, 2.7), _plan([3, 1], 298, 2.6), _plan([4, 2, 1, 1], 200, 3.0)]
    ranked.append(_plan([1, 1, 1], 150, 2.3))
    calls = []
    decode = _fake_decodes(
        {None: 100.0, (2, 1, 1): 140.0, (3, 1): 170.0, (1, 1, 1): 150.0},
        calls,
        tau={(2, 1, 1): 2.4, (3, 1): 2.4, (1, 1, 1): 2.0},
    )
    best = settle_by_decoding(ranked, decode, rounds=3, band=0.05, most=4, remeasure=False)
    first = [None, (2, 1, 1), (3, 1), (1, 1, 1)]
    assert calls == [(k, 0) for k in first] + [(k, 1) for k in first[::-1]] + [(k, 2) for k in first]
    assert best.tree == [3, 1] and best.measured  # 170 tok/s, 13% above the chain's 150
    assert best.tokens_per_s == pytest.approx(170.0) and best.speedup == pytest.approx(1.7)
    assert (
        best.tau == pytest.approx(48 / 20)
        and best.tau_model == 2.6
        and best.speedup_model == pytest.approx(2.98)
    )
    assert [c["tree"] for c in best.candidates] == [[2, 1, 1], [3, 1], [1, 1, 1]]
    assert best.candidates[2]["speedup"] == pytest.approx(1.5) and best.candidates[2]["tau_model"] == 2.3


def test_the_winner_is_remeasured_on_fresh_rounds():
    """The winner's curse: of near-tied candidates the one whose rounds were luckiest wins, so its figures from
    those rounds are biased up. The chosen plan and AR are decoded again on FRESH rounds (other round indices:
    other seeds; REMEASURE_PASSES x as many), and the plan's tau and speedup are those; the selection figures are
    kept apart. A tree chosen over the best chain is decoded there beside the chain and must beat it again."""
    ranked = [_plan([2, 1], 300, 2.6), _plan([1, 1], 280, 2.2)]

    def run(later_tps: float):
        calls = []

        def decode(tree, rnd):
            calls.append((None if tree is None else tuple(tree), rnd))
            lucky = tree == [2, 1] and rnd < 2  # the tree's selection rounds were lucky: 180 tok/s
            tps = 100.0 if tree is None else 180.0 if lucky else later_tps if tree == [2, 1] else 150.0
            return Decoded(48, 20, 30 if lucky else 22, 48 / tps)

        return settle_by_decoding(ranked, decode, rounds=2), calls

    plan, calls = run(160.0)  # still ahead of the chain (150) on the fresh rounds: kept
    assert plan.tree == [2, 1] and plan.selected_speedup == pytest.approx(1.8)
    assert plan.speedup == pytest.approx(1.6) and plan.tau == pytest.approx(42 / 20)
    assert plan.selected_tau == pytest.approx(50 / 20) and plan.tau_model == 2.6
    fresh = [(None, 2), ((2, 1), 2), ((1, 1), 2), ((1, 1), 3), ((2, 1), 3), (None, 3)]
    fresh += [(None, 4), ((2, 1), 4), ((1, 1), 4), ((1, 1), 5), ((2, 1), 5), (None, 5)]
    assert REMEASURE_PASSES == 2 and [c for c in calls if c[1] >= 2] == fresh  # ABBA
    assert "chosen at 1.80x" in plan.describe()
    plan, _ = run(120.0)  # ahead only by the luck of the selection rounds: the chain, on its fresh figures
    assert (
        plan.tree == [1, 1]
        and plan.speedup == pytest.approx(1.5)
        and plan.selected_speedup == pytest.approx(1.5)
    )
    assert [c["tree"] for c in plan.candidates] == [[2, 1], [1, 1]]


def test_a_chain_winner_meets_the_next_fastest_again_on_fresh_rounds():
    """A chain that won the settling only by its rounds' luck: it is decoded on the fresh rounds beside the
    settling's next fastest, and the runner-up, faster there, is the plan (its figures from those rounds)."""
    ranked = [_plan([1, 1, 1], 300, 2.1), _plan([1, 1, 1, 1], 290, 2.3), _plan([4, 2], 200, 2.9)]
    calls = []

    def decode(tree, rnd):
        calls.append((None if tree is None else tuple(tree), rnd))
        fresh = rnd >= 2
        tps = {None: 100.0, (1, 1, 1): 150.0 if fresh else 180.0, (1, 1, 1, 1): 165.0 if fresh else 160.0}
        return Decoded(48, 20, 22, 48 / tps.get(None if tree is None else tuple(tree), 120.0))

    plan = settle_by_decoding(ranked, decode, rounds=2, band=0.05)
    assert plan.tree == [1, 1, 1, 1] and plan.speedup == pytest.approx(1.65)
    assert plan.selected_speedup == pytest.approx(1.6)  # its figure in the settling rounds
    assert {c[0] for c in calls if c[1] >= 2} == {None, (1, 1, 1), (1, 1, 1, 1)}  # the runner-up, not [4, 2]
    # the runner-up no faster on the fresh rounds: the settling's winner stays
    calls.clear()
    again = settle_by_decoding(
        ranked, lambda t, r: decode(t if t != [1, 1, 1, 1] else [9], r), rounds=2, band=0.05
    )
    assert again.tree == [1, 1, 1]


def test_the_runner_up_of_the_settling_can_win_on_fresh_rounds():
    """FINALISTS: a chain winner of the settling meets the runner-up on the fresh rounds; the runner-up, fastest
    there, is the plan; the third is not decoded again."""
    assert FINALISTS == 2
    ranked = [_plan([1, 1, 1], 300), _plan([1, 1, 1, 1], 299), _plan([2, 1, 1], 298), _plan([3, 1, 1], 297)]
    settling = {(1, 1, 1): 171.0, (1, 1, 1, 1): 166.0, (2, 1, 1): 150.0, (3, 1, 1): 149.0}
    fresh = {(1, 1, 1): 140.0, (1, 1, 1, 1): 152.0, (2, 1, 1): 200.0, (3, 1, 1): 200.0}
    calls = []

    def decode(tree, rnd):
        key = None if tree is None else tuple(tree)
        calls.append((key, rnd))
        tps = 100.0 if key is None else (fresh if rnd >= 2 else settling)[key]
        return Decoded(48, 20, 22, 48 / tps)

    plan = settle_by_decoding(ranked, decode, rounds=2, band=0.05)
    assert plan.tree == [1, 1, 1, 1] and plan.speedup == pytest.approx(1.52)
    assert {k for k, r in calls if r >= 2} == {None, (1, 1, 1), (1, 1, 1, 1)}  # not the third or fourth


def test_the_remeasured_speedup_shrugs_off_one_slow_decode():
    """The re-measured speedup is a ratio of sums without the highest- and lowest-ratio rounds: one AR decode caught
    by another process's burst (4x slower) does not move it, where a plain ratio of the sums would read 1.5x ->
    1.8x."""

    def decode(tree, rnd):
        slow = tree is None and rnd == 5  # one fresh round's AR decode, 4x slower
        tps = 100.0 / (4 if slow else 1) if tree is None else 150.0
        return Decoded(48, 20, 28, 48 / tps)

    plan = settle_by_decoding([_plan([1, 1], 150)], decode, rounds=4)
    assert plan.speedup == pytest.approx(1.5) and plan.tokens_per_s == pytest.approx(150.0)


def test_the_measured_speedup_is_the_benchs_ratio_of_sums_not_a_median():
    """Prompts whose speedups spread wide: the bench's figure is the ratio of the summed tokens per second, which
    weighs a slow prompt by its time; a median of the rounds' ratios would read far above it (here 1.5x, against
    0.83x for the plain ratio of sums and 0.9x trimmed)."""
    from resispec.decoding.planner.settle import as_measured, trimmed_speedup

    ar = [Decoded(48, 48, 0, 0.48) for _ in range(5)]  # AR: 100 tok/s on every prompt
    seconds = [0.96, 0.96, 0.32, 0.32, 0.32]  # the candidate: 0.5x on two prompts, 1.5x on three
    runs = [Decoded(48, 20, 28, s) for s in seconds]
    speedup, ar_tps = trimmed_speedup(runs, ar)
    # the rounds with the lowest (0.5x) and the highest (1.5x) ratio dropped: 0.5x, 1.5x, 1.5x left
    assert speedup == pytest.approx((3 * 48 / (0.96 + 0.32 + 0.32)) / 100.0) and ar_tps == pytest.approx(
        100.0
    )
    assert speedup == pytest.approx(0.9)
    assert trimmed_speedup(runs[:2], ar[:2])[0] == pytest.approx(0.5)  # two rounds: nothing dropped
    plan = as_measured(_plan([1, 1], 150), runs, ar)
    assert plan.speedup == pytest.approx(0.9) and plan.tokens_per_s == pytest.approx(90.0)


def test_at_t_above_zero_a_chain_is_measured_with_the_models_tau():
    """Issue 45's T = 1 miss: four calibration decodes read [1,1,1]'s tau 13% above the model (2.95 against 2.60;
    chains decoded 96 times on 12 test prompts: 2.57) and [1,1,1,1]'s on it, so [1,1,1] measured fastest and the
    bench put [1,1,1,1] ahead. With tau_from_model="chains" (the planner's setting at T > 0) a chain's tau is the
    model's and its speedup is scaled by model / decoded tau: [1,1,1,1] wins. A tree keeps its decoded tau; without
    the setting nothing changes."""
    ranked = [_plan([1, 1, 1], 300, 2.60), _plan([1, 1, 1, 1], 299, 2.87), _plan([2, 1, 1], 298, 3.5)]
    step_ms = {(1, 1, 1): 14.0, (1, 1, 1, 1): 15.0, (2, 1, 1): 17.0}
    decoded_tau = {(1, 1, 1): 3.0, (1, 1, 1, 1): 48 / 17, (2, 1, 1): 3.2}

    def decode(tree, rnd):
        if tree is None:
            return Decoded(48, 48, 0, 0.48)  # AR: 100 tok/s
        key = tuple(tree)
        steps = round(48 / decoded_tau[key])
        return Decoded(48, steps, 48 - steps, steps * step_ms[key] / 1e3)

    plain = settle_by_decoding(ranked, decode, rounds=2)
    assert plain.tree == [1, 1, 1] and plain.tau == pytest.approx(3.0) and plain.tau_decoded is None
    assert plain.speedup == pytest.approx(48 / (16 * 0.014) / 100)  # 2.14x as decoded
    plan = settle_by_decoding(ranked, decode, rounds=2, tau_from_model="chains")
    assert (
        plan.tree == [1, 1, 1, 1]
        and plan.tau == pytest.approx(2.87)
        and plan.tau_model == pytest.approx(2.87)
    )
    assert plan.tau_decoded == pytest.approx(48 / 17)
    assert plan.speedup == pytest.approx(48 / (17 * 0.015) / 100 * 2.87 / (48 / 17))
    assert "the model's; decoded 2.82" in plan.describe()
    by_tree = {tuple(c["tree"]): c for c in plan.candidates}
    assert by_tree[(1, 1, 1)]["tau"] == pytest.approx(2.60) and by_tree[(1, 1, 1)]["tau_decoded"] == 3.0
    assert by_tree[(1, 1, 1)]["speedup"] == pytest.approx(48 / (16 * 0.014) / 100 * 2.60 / 3.0)
    assert by_tree[(2, 1, 1)]["tau"] == pytest.approx(3.2) and by_tree[(2, 1, 1)]["tau_decoded"] is None
    # the scale is the model's tau over the decoded tau of the rounds the speedup sums (the middle one of three)
    from resispec.decoding.planner.settle import as_measured

    ar = [Decoded(48, 48, 0, 0.48)] * 3
    runs = [Decoded(48, n, 48 - n, n * 0.014) for n in (24, 16, 21)]  # 1.43x, 2.14x, 1.63x
    m = as_measured(_plan([1, 1, 1], 300, 2.6), runs, ar, tau_from_model="chains")
    assert m.speedup == pytest.approx(48 / (21 * 0.014) / 100 * 2.6 / (48 / 21))
    assert m.tau == 2.6 and m.tau_decoded == pytest.approx(144 / 61)


def test_at_t_zero_every_plan_is_measured_with_its_counted_tau():
    """Issue 45's T = 0 misses (runs AD, AE, AF: the distilled draft chose [1]*5 or deeper and the bench put
    [1,1,1,1] 7% ahead): the settling prompts flattered depth, [1]*5 decoding tau 3.31 there against 2.94 counted
    over all 12 planner prompts, [1,1,1,1] 2.95 against 2.70, with steps of 17.1 and 15.4 ms. Decoded, a tree as
    flattered wins; with tau_from_model="all" (the planner at T = 0: every tau greedy_tau's count, trees alike)
    [1,1,1,1] does."""
    ranked = [_plan([1] * 5, 300, 2.94), _plan([1] * 4, 299, 2.70), _plan([2, 1, 1], 298, 2.80)]
    step_ms = {(1,) * 5: 17.06, (1,) * 4: 15.4, (2, 1, 1): 16.0}
    decoded_tau = {(1,) * 5: 3.31, (1,) * 4: 2.95, (2, 1, 1): 3.30}

    def decode(tree, rnd):
        if tree is None:
            return Decoded(480, 480, 0, 4.8)  # AR: 100 tok/s
        steps = round(480 / decoded_tau[tuple(tree)])
        return Decoded(480, steps, 480 - steps, steps * step_ms[tuple(tree)] / 1e3)

    assert settle_by_decoding(ranked, decode, rounds=2).tree == [2, 1, 1]  # decoded: flattered alike
    plan = settle_by_decoding(ranked, decode, rounds=2, tau_from_model="all")
    assert plan.tree == [1] * 4 and plan.tau == pytest.approx(2.70)
    assert plan.tau_decoded == pytest.approx(2.95, abs=0.01)
    by_tree = {tuple(c["tree"]): c for c in plan.candidates}
    assert by_tree[(2, 1, 1)]["tau"] == pytest.approx(2.80)  # a tree too: counted, not decoded
    assert by_tree[(2, 1, 1)]["tau_decoded"] == pytest.approx(480 / 145)


def test_measured_plans_are_compared_by_speedup_not_tokens_per_second():
    """Each candidate's trim keeps its own rounds (kept_rounds), so its tokens per second carries AR's speed in
    those rounds: here the chain's kept rounds caught AR at 75 tok/s, the tree's at 100. Compared by speedup over
    AR of the same rounds, the chain (1.6x) is ahead of the tree (1.5x), whatever their tokens per second say."""
    chain = replace(_plan([1, 1, 1], 120.0), speedup=1.6, measured=True)
    tree = replace(_plan([2, 1, 1], 150.0), speedup=1.5, measured=True)
    assert pick_measured([chain, tree]).tree == [1, 1, 1]
    assert pick_measured([replace(chain, speedup=1.4), tree]).tree == [2, 1, 1]


def test_a_chain_is_always_decoded_and_wins_ties():
    """A chain is decoded even when the model clearly prefers a tree; a tree must measure more than TIE_MARGIN
    faster than the best chain, so an exact tie, or a tree 1% ahead, goes to the chain."""
    ranked = [_plan([4, 2], 300), _plan([3, 2], 250), _plan([1, 1], 120), _plan([1], 100)]
    assert [p.tree for p in settle_candidates(ranked)] == [[4, 2], [1, 1]]
    for tree_tps, winner in ((150.0, [1, 1]), (151.5, [1, 1]), (150.0 * (1 + TIE_MARGIN) + 0.5, [4, 2])):
        decode = _fake_decodes({None: 100.0, (4, 2): tree_tps, (1, 1): 150.0})
        assert settle_by_decoding(ranked, decode, rounds=2).tree == winner, tree_tps
    assert pick_measured([_plan([2, 1], 200), _plan([1, 1], 150), _plan([1], 160)]).tree == [2, 1]
    assert pick_measured([_plan([2, 1], 160), _plan([1, 1], 150), _plan([1], 160)]).tree == [1]


def test_a_tree_ahead_of_the_chain_by_less_than_the_noise_loses():
    """The tie margin widens to TIE_Z standard errors of the two measured taus' relative difference: a tree 5%
    faster than the chain on taus each 5% noisy (a 7% margin) is a tie, and goes to the chain; on 1% noise it wins.
    Decoded's standard error is tau's over the steps."""
    d = Decoded(tokens=30, steps=10, accepted=20, seconds=1.0, accepted_sq=50)  # 2 +- 1 accepted a step
    assert d.tau == 3.0 and d.tau_stderr == pytest.approx(math.sqrt((50 / 10 - 4) / 9))
    for noise, winner in ((0.05, [1, 1]), (0.01, [2, 1])):
        tree, chain = _plan([2, 1], 157.5, 2.5), _plan([1, 1], 150.0, 2.5)
        tree.tau_stderr = chain.tau_stderr = noise * 2.5
        assert tie_margin(tree, chain) == pytest.approx(max(TIE_MARGIN, TIE_Z * noise * math.sqrt(2)))
        assert pick_measured([tree, chain]).tree == winner, noise


def test_the_product_models_favourite_that_decodes_slower_loses_to_the_chain():
    """The planted case of the issue: calibrated acceptances where more draws look much better (alpha(2..4) high,
    multiplied as if depths were independent), so the model ranks a multi-draw tree first, clearly ahead of every
    chain; decoded, the tree is slower than the chain (its tau over-predicted, its step dearer). The chain wins."""
    alpha = {1: 0.55, 2: 0.85, 3: 0.92, 4: 0.95}
    ranked = rank_trees(_costs(0.2, verify_ms={1: 0.2, 2: 0.3, 3: 0.35, 4: 0.4}), alpha)
    assert not ranked[0].is_chain
    chain = next(p for p in ranked if p.is_chain)
    assert ranked[0].tokens_per_s > 1.1 * chain.tokens_per_s  # the model is sure
    tps = {None: 100.0, tuple(chain.tree): 150.0}
    tps.update({tuple(p.tree): 140.0 for p in ranked if not p.is_chain})
    plan = settle_by_decoding(ranked, _fake_decodes(tps), rounds=2)
    assert plan.tree == chain.tree and plan.measured and plan.speedup == pytest.approx(1.5)
    assert plan.speedup_model < ranked[0].speedup


def test_batch_one_plan_is_decoded_and_the_chain_wins_in_the_planner(micro_pair, monkeypatch):
    """Planner.choose decodes the candidates for real (here planted: the model's first tree slower than its chain),
    the best chain always among them, AR alongside, and keeps the chain."""
    from resispec.decoding.planner import core as planner_mod

    calls = []
    real_alpha = planner_mod.sampled_alpha
    monkeypatch.setattr(  # the model wants trees (the first prompt's node logits real: the verification's timing)
        planner_mod,
        "sampled_alpha",
        lambda *a, **kw: ({1: 0.55, 2: 0.85, 3: 0.92, 4: 0.95}, real_alpha(*a, **kw)[1]),
    )
    # ... and ranks them first whatever the forward timings of a loaded machine say
    real_rank = planner_mod.rank_trees
    monkeypatch.setattr(
        planner_mod,
        "rank_trees",
        lambda cost, alpha, **kw: [_plan([3, 1], 300), _plan([2, 1], 295)] + real_rank(cost, alpha, **kw),
    )

    def fake_call(self, tree, rnd):
        calls.append((None if tree is None else tuple(tree), rnd, self.sampling["temperature"]))
        tps = 100.0 if tree is None else 150.0 if set(tree) == {1} else 140.0
        # a chain decodes the model's tau (T = 1: the one it is given)
        if tree is not None and set(tree) == {1}:
            steps = 1000
            return Decoded(48, steps, round(steps * (expected_tau(tree, {1: 0.55}) - 1)), 48 / tps)
        return Decoded(48, 20, 28, 48 / tps)

    monkeypatch.setattr(planner_mod.CalibrationDecodes, "__call__", fake_call)
    target, draft = micro_pair
    with single_thread():
        planner = Planner(target, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], continuation_tokens=8)
        plan = planner.choose(draft, "resispec", {"temperature": 1.0})
    # T = 1: the chain's tau is the model's (alpha(1) = 0.55), its decoded one beside it
    assert plan.is_chain and plan.measured and plan.speedup == pytest.approx(1.5, rel=1e-3)
    assert plan.tau == pytest.approx(expected_tau(plan.tree, {1: 0.55}))
    assert plan.tau_decoded == pytest.approx(plan.tau, rel=1e-3)
    decoded = {t for t, _, _ in calls}
    assert None in decoded and any(t is not None and set(t) == {1} for t in decoded)
    assert any(t is not None and set(t) != {1} for t in decoded)
    # rounds 2 .. 5: the winner again (REMEASURE_PASSES x the 2 rounds), beside the next fastest of the settling
    assert {r for _, r, _ in calls} == set(range(2 + 2 * REMEASURE_PASSES)) and plan.startup_s > 0
    settled = {t for t, r, _ in calls if r < 2} - {None}
    fresh = {t for t, r, _ in calls if r >= 2}
    assert len(fresh) == 1 + min(FINALISTS, len(settled)) and {None, tuple(plan.tree)} < fresh


def test_settling_work_is_bounded(micro_pair, monkeypatch):
    """Start-up is bounded in work, not wall clock: at batch 1 at most (SETTLE_MOST + 2) decoders (the candidates,
    the best chain, AR), each one warm-up of 8 tokens and one decode of SETTLE_TOKENS per round, and at most
    SETTLE_PROMPTS rounds however many calibration prompts; at a batched size where speculation is planned, at most
    (BATCH_SETTLE_MOST + 2) x BATCH_SETTLE_ROUNDS decodes of BATCH_SETTLE_STEPS + 1 steps each."""
    from resispec.decoding.batch import BatchedSpeculativeDecoder
    from resispec.decoding.planner import core as planner_mod

    runs, steps = [], []
    real_run = planner_mod.CalibrationDecodes._run
    monkeypatch.setattr(
        planner_mod.CalibrationDecodes,
        "_run",
        lambda self, key, ids, seed, n: runs.append((key, n)) or real_run(self, key, ids, seed, n),
    )
    real_step = BatchedSpeculativeDecoder.step
    monkeypatch.setattr(
        BatchedSpeculativeDecoder, "step", lambda self, draft=True: steps.append(1) or real_step(self, draft)
    )
    # the model plans speculation at 4 rows: its ranking with every speedup above 1
    real_rank = planner_mod.rank_trees
    monkeypatch.setattr(
        planner_mod,
        "rank_trees",
        lambda cost, alpha, **kw: [
            replace(p, speedup=p.speedup + 10.0) for p in real_rank(cost, alpha, **kw)
        ],
    )
    target, draft = micro_pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (6,), generator=gen).tolist() for _ in range(10)]
    with single_thread():
        planner = Planner(target, prompts, continuation_tokens=4)
        steps.clear()  # measure_batch_overhead's steps are the model's, counted apart
        monkeypatch.setattr(planner_mod, "measure_batch_overhead", lambda *a, **kw: 0.0)
        plans = planner.choose_by_batch(draft, "resispec", {"temperature": 1.0}, [1, 4])
    decoders = {key for key, _ in runs}
    assert len(decoders) <= SETTLE_MOST + 2 and None in decoders
    assert [n for _, n in runs].count(8) == len(decoders)  # one warm-up each
    timed = [n for _, n in runs if n != 8]
    # the candidates and AR once a round, then on REMEASURE_PASSES x as many fresh rounds AR, the winner and the
    # best chain (a tree won) or the runner-up (a chain won) beside it
    # best chain (a tree won) and the next fastest beside it: min(1 + FINALISTS, decoders) a fresh round
    assert all(n == SETTLE_TOKENS for n in timed)
    fresh = min(1 + FINALISTS, len(decoders)) * REMEASURE_PASSES
    assert len(timed) == (len(decoders) + fresh) * SETTLE_PROMPTS
    assert len(plans[1].candidates) == len(decoders) - 1 and plans[4].measured
    batched = len(plans[4].candidates) + 1
    assert batched <= BATCH_SETTLE_MOST + 2
    fresh = min(1 + FINALISTS, batched) * REMEASURE_PASSES
    assert len(steps) == (batched + fresh) * BATCH_SETTLE_ROUNDS * (BATCH_SETTLE_STEPS + 1)


def test_the_prediction_comes_from_prompts_that_did_not_choose_the_tree(micro_pair, monkeypatch):
    """With 3 x SETTLE_PROMPTS prompts, the first SETTLE_PROMPTS settle the near-ties, and the winner's fresh
    re-measure decodes the other 8, once each: the prediction is not made on the prompts whose luck chose the tree.
    At T > 0 the first ALPHA_PROMPTS (here all 12) calibrate alpha, each with its sampled continuation."""
    from resispec.decoding.planner import core as planner_mod

    prompts = [[1 + i, 2, 3, 4, 5, 6 + i] for i in range(3 * SETTLE_PROMPTS)]
    calibrated, used = [], []
    real_alpha = planner_mod.sampled_alpha

    def spy(t, d, seqs, starts, *a, **kw):
        calibrated.extend(s[:start] for s, start in zip(seqs, starts, strict=True))
        assert all(len(s) == start + 4 for s, start in zip(seqs, starts, strict=True))  # 4 tokens sampled
        return real_alpha(t, d, seqs, starts, *a, **kw)

    monkeypatch.setattr(planner_mod, "sampled_alpha", spy)

    decoded = []

    def fake_call(self, tree, rnd):
        used.append((rnd, tuple(self.prompts[rnd % len(self.prompts)])))
        decoded.append((rnd, None if tree is None else tuple(tree)))
        return Decoded(48, 20, 28, 48 / (100.0 if tree is None else 150.0))

    monkeypatch.setattr(planner_mod.CalibrationDecodes, "__call__", fake_call)
    target, draft = micro_pair
    with single_thread():
        Planner(target, prompts, continuation_tokens=4).choose(draft, "resispec", {"temperature": 1.0})
    assert calibrated == prompts[:ALPHA_PROMPTS] and ALPHA_PROMPTS >= len(prompts)
    assert {p for r, p in used if r < SETTLE_PROMPTS} == {tuple(p) for p in prompts[:SETTLE_PROMPTS]}
    fresh = sorted(p for r, p in used if r >= SETTLE_PROMPTS)
    # AR and the finalists (the winner and the next fastest) on each
    finalists = len({t for r, t in decoded if r >= SETTLE_PROMPTS})
    assert finalists >= 2 and fresh == sorted(finalists * [tuple(p) for p in prompts[SETTLE_PROMPTS:]])


def test_calibration_decodes_are_seeded_alike_and_real(micro_pair, monkeypatch):
    """The settling decodes at batch 1 and at 3 rows: a round's draws are the same for every call (so candidates
    differ by their trees, not their luck), AR's tau is 1, and a speculative tree accepts some tokens. EOS stops
    none of them (every token an EOS here): each emits its full length, so a draw that hits EOS early does not
    weigh its prefill against another candidate's longer decode."""
    from resispec.decoding.planner import core as planner_mod
    from resispec.verify import build_rule

    target, draft = micro_pair
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]]
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    monkeypatch.setattr(target.generation_config, "eos_token_id", list(range(target.config.vocab_size)))
    with single_thread():
        one = planner_mod.CalibrationDecodes(target, draft, build_rule("resispec"), prompts, sampling, 16)
        a, b = one([2, 1], 1), one([2, 1], 1)
        assert (a.tokens, a.steps, a.accepted) == (b.tokens, b.steps, b.accepted) and a.tokens == 16
        ar = one(None, 0)
        assert ar.tokens == 16 and ar.tau == 1.0 and ar.seconds > 0
        rows = planner_mod.BatchedCalibrationDecodes(
            target, draft, build_rule("resispec"), prompts, sampling, rows=3, steps=4
        )
        c, d = rows([2, 1], 0), rows([2, 1], 0)
        assert (c.tokens, c.steps, c.accepted) == (d.tokens, d.steps, d.accepted) and c.steps == 3 * 4
        assert rows(None, 0).tokens == 3 * 4 and c.tokens >= 3 * 4


def test_planner_calibrates_the_rule_it_decodes_with(micro_pair, monkeypatch, fake_settling):
    """The calibration scores the rule the decoder runs: resispec_auto built with the given policy, not the
    registry's default one."""
    from resispec.decoding.planner import core as planner_mod
    from resispec.verify import VERIFIERS

    rules = []
    real = planner_mod.sampled_alpha

    def spy(t, d, seqs, starts, rule, *a, **kw):
        rules.append(rule)
        return real(t, d, seqs, starts, rule, *a, **kw)

    monkeypatch.setattr(planner_mod, "sampled_alpha", spy)
    target, draft = micro_pair
    with single_thread():
        planner = Planner(target, [[1, 2, 3, 4, 5, 6]], continuation_tokens=8)
        planner.choose(draft, "resispec", {"temperature": 1.0})
        plan = planner.choose(draft, "resispec_auto", {"temperature": 1.0}, auto_policy={"threshold": 0.9})
    assert rules[0] is VERIFIERS["resispec"]
    assert rules[1] is not VERIFIERS["resispec_auto"] and rules[1].policy.threshold == 0.9
    assert plan.measured and plan.tau_model == pytest.approx(expected_tau(plan.tree, plan.alpha))


# ------------------------------------------------------------------------------------------ measured on micro models


@pytest.fixture
def fake_settling(monkeypatch):
    """The settling decodes (batch 1 and batched) replaced by a flat fake, for tests about something else."""
    from resispec.decoding.planner import core as planner_mod

    fake = lambda self, tree, rnd: Decoded(48, 24, 24, 0.1)  # noqa: E731
    monkeypatch.setattr(planner_mod.CalibrationDecodes, "__call__", fake)
    monkeypatch.setattr(planner_mod.BatchedCalibrationDecodes, "__call__", fake)


@pytest.fixture(scope="module")
def micro_pair():
    with single_thread():
        target = micro_llama(64, 2, 64, seed=0)
        yield target, noisy_copy(target, 0.5, seed=1)


def test_calibration_greedy_and_sampled(micro_pair):
    target, draft = micro_pair
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (24,), generator=gen).tolist() for _ in range(2)]
    greedy = calibrate_alpha(target, draft, seqs, "resispec", {"temperature": 0.0}, start=8)
    assert all(0.0 <= greedy[n] <= 1.0 for n in greedy)
    assert all(greedy[n] <= greedy[n + 1] for n in range(1, 4))  # top-n of q can only cover more
    same = calibrate_alpha(target, target, seqs, "resispec", {"temperature": 0.0}, start=8)
    assert same[1] == 1.0  # the draft IS the target: its argmax is always the target's
    sampled = calibrate_alpha(target, draft, seqs, "resispec", {"temperature": 1.0}, start=8)
    assert all(
        sampled[n] <= sampled[n + 1] + 1e-9 for n in range(1, 4)
    )  # more i.i.d. draws never hurt resispec
    same_s = calibrate_alpha(target, target, seqs, "resispec", {"temperature": 1.0}, start=8)
    assert same_s[1] == pytest.approx(1.0)


def test_sampled_alpha_batches_the_continuations_as_one_at_a_time(micro_pair):
    """sampled_alpha (the planner's T > 0 calibration): batched, right-padded teacher-forced forwards of
    continuations of one length from different starts give the mean of calibrate_alpha's per-continuation alphas,
    and the first continuation's node logits."""
    target, draft = micro_pair
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 64, (n + 10,), generator=gen).tolist() for n in (4, 7, 5)]
    starts = [4, 7, 5]  # 10 continuation tokens each, from different starts: padding in every chunk
    settings = {"temperature": 1.0}
    alpha, (t_first, d_first) = sampled_alpha(target, draft, seqs, starts, "resispec", settings, rows=2)
    each = [
        calibrate_alpha(target, draft, [s], "resispec", settings, start=k)
        for s, k in zip(seqs, starts, strict=True)
    ]
    assert alpha == pytest.approx({n: sum(a[n] for a in each) / 3 for n in each[0]}, abs=1e-5)
    t_ref, d_ref = node_logits(target, draft, [seqs[0]], starts[0])
    assert torch.allclose(t_first, t_ref, atol=1e-4) and torch.allclose(d_first, d_ref, atol=1e-4)


def test_verify_cost_is_measured_per_draw_count(micro_pair):
    ms = measure_verify_ms(build_rule("resispec"), vocab=512, max_draws=3, reps=3)
    assert sorted(ms) == [1, 2, 3] and all(v > 0 for v in ms.values())
    # on real nodes (the calibration's): each timed call takes the next node's (p, q), cycling
    target, draft = micro_pair
    seq = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    t_logits, d_logits = node_logits(target, draft, [seq], start=20)
    assert t_logits.shape == d_logits.shape == (4, 64)
    nodes = torch.softmax(t_logits, -1), torch.softmax(d_logits, -1)
    seen = []
    rule = build_rule("resispec")
    verify = rule.verify
    rule.verify = lambda p, proposal, rng: seen.append(p) or verify(p, proposal, rng)
    ms = measure_verify_ms(rule, vocab=64, max_draws=2, reps=5, nodes=nodes)
    assert sorted(ms) == [1, 2] and len(seen) == 2 * 7
    for i, p in enumerate(seen[:7]):
        assert torch.equal(p, nodes[0][i % 4 : i % 4 + 1])
    assert measure_verify_row_ms(build_rule("resispec"), vocab=64, reps=3, nodes=nodes) >= 0.0
    # between: one forward of that model before each timed call (as the decoder's walk follows the target's forward)
    calls = []
    seconds = ForwardProbe.seconds
    ForwardProbe.seconds = lambda self, n=1: calls.append(n) or seconds(self, n)
    try:
        measure_verify_ms(build_rule("resispec"), vocab=64, max_draws=2, reps=3, nodes=nodes, between=target)
        assert calls == [1] * 2 * (3 + 2)
    finally:
        ForwardProbe.seconds = seconds


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_planner_choose_on_micro_models(micro_pair, temperature):
    target, draft = micro_pair
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (6,), generator=gen).tolist() for _ in range(2)]
    with single_thread():
        planner = Planner(target, prompts, continuation_tokens=12)
        plan = planner.choose(draft, "resispec", {"temperature": temperature, "top_k": 0, "top_p": 1.0})
    assert plan.tree in candidate_trees(max_branch=max(plan.alpha))
    assert 1.0 <= plan.tau <= 1 + len(plan.tree)
    # a chain at T > 0 is measured with the model's tau, a tree with its decoded one; at T = 0 every plan with its
    # exact count over every prompt's greedy continuation
    assert (plan.tau_decoded is not None) == (plan.is_chain or temperature == 0)
    if temperature == 0:
        assert plan.tau == pytest.approx(greedy_tau(plan.tree, planner._greedy_hit_sets(draft)))
    assert plan.step_ms > 0 and plan.speedup > 0
    cost = planner.cost_for(draft)
    assert set(cost.target_ms) == set(cost.draft_ms)


def test_t_zero_counts_tau_on_every_prompt_and_books_the_continuations_apart(
    micro_pair, monkeypatch, fake_settling
):
    """At T = 0 the plan's tau is greedy_tau over ALL the planner's prompts (not only the SETTLE_PROMPTS that
    settle, nor the 8 fresh rounds'); the target's greedy continuations are made once, by the first T = 0 plan,
    and their seconds go to Planner.greedy_s, not to that plan's startup_s; T > 0 makes none."""
    import time as time_mod

    from resispec.decoding.batch_ar import BatchedDecoder

    real_generate = BatchedDecoder.generate
    made = []

    def slow_generate(self, prompts, settings=None):
        if isinstance(settings, dict) and settings.get("temperature") == 0.0:  # greedy continuations only
            made.append(len(prompts))
            time_mod.sleep(1.0)
        return real_generate(self, prompts, settings)

    monkeypatch.setattr(BatchedDecoder, "generate", slow_generate)
    target, draft = micro_pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (6,), generator=gen).tolist() for _ in range(4 * SETTLE_PROMPTS)]
    with single_thread():
        planner = Planner(target, prompts, continuation_tokens=4)
        planner.choose(draft, "resispec", {"temperature": 1.0})
        assert made == [] and planner.greedy_s == 0.0
        t0 = time_mod.perf_counter()
        plan = planner.choose(draft, "resispec", {"temperature": 0.0})
        wall = time_mod.perf_counter() - t0
        again = planner.choose(draft, "resispec_auto", {"temperature": 0.0})
    assert made == [len(prompts)] and planner.greedy_s >= 1.0
    assert plan.startup_s <= wall - 1.0 and again.startup_s < wall
    hit_sets = planner._greedy_hit_sets(draft)
    assert len(hit_sets) == len(prompts) and plan.tau_model == pytest.approx(greedy_tau(plan.tree, hit_sets))
    assert plan.tau_model != pytest.approx(greedy_tau(plan.tree, hit_sets[:SETTLE_PROMPTS]))


def test_planner_by_batch_size_measures_each_size(micro_pair, fake_settling):
    """One calibration, forward tables per batch size (times are not compared: on micro models the fast forward
    takes well under a millisecond and a shared machine's noise decides their order)."""
    target, draft = micro_pair
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 64, (6,), generator=gen).tolist() for _ in range(2)]
    with single_thread():
        planner = Planner(target, prompts, continuation_tokens=12)
        plans = planner.choose_by_batch(draft, "resispec", {"temperature": 0.0}, [1, 4])
        one, four = planner.cost_for(draft, 1), planner.cost_for(draft, 4)
    assert sorted(plans) == [1, 4]
    assert plans[1].alpha == plans[4].alpha  # acceptance is per row: one calibration
    assert set(four.target_ms) == set(BATCH_NODE_GRID) and set(one.target_ms) == set(NODE_GRID)
    assert all(ms > 0 for table in (one.target_ms, four.target_ms, four.draft_ms) for ms in table.values())
    for plan in plans.values():
        assert plan.tree in candidate_trees(max_branch=max(plan.alpha)) and plan.step_ms > 0


def test_planner_times_each_batch_size_on_its_threads(micro_pair, monkeypatch, fake_settling):
    """threads_at (the server's threads_by_rows): each size's forward tables and overhead are timed on the threads
    that size will decode on, and torch's setting is restored afterwards."""
    from resispec.decoding.planner import core as planner_mod

    seen = []
    real_table = planner_mod.forward_table

    def table(model, nodes, reps, batch, between=None):
        seen.append((batch, torch.get_num_threads()))
        return real_table(model, nodes[:2], reps=1, batch=batch, between=between)

    monkeypatch.setattr(planner_mod, "forward_table", table)
    target, draft = micro_pair
    with single_thread():
        planner = Planner(target, [[1, 2, 3, 4, 5, 6]], continuation_tokens=8)
        planner.choose_by_batch(
            draft, "chain", {"temperature": 0.0}, [1, 2, 4], threads_at=lambda b: 2 if b >= 4 else 1
        )
        assert torch.get_num_threads() == 1
    assert sorted(set(seen)) == [(1, 1), (2, 1), (4, 2)]


def test_batch_overhead_is_measured_at_the_batch_size(micro_pair, monkeypatch):
    """The batched decoder's host work is timed with that many rows: what the forwards (as timed) do not explain.
    With forwards predicted free the whole step is overhead; with forwards predicted enormous, none is. (The speed
    drift correction is held at 1: scaled to a table of 1e6 ms a forward, a loaded machine's step looked
    enormous too; test_overhead_is_scaled_to_the_speed_of_the_tables checks it.)"""
    from resispec.decoding.planner import cost as planner_mod

    monkeypatch.setattr(planner_mod, "drift", lambda cost, references: 1.0)
    target, draft = micro_pair
    prompt = [1, 2, 3, 4, 5]
    with single_thread():
        for temperature, alpha in ((0.0, None), (1.0, {1: 0.5, 2: 0.6})):
            free = CostModel({1: 0.0}, {1: 0.0})
            ms = measure_batch_overhead(
                target,
                draft,
                build_rule("resispec"),
                prompt,
                {"temperature": temperature},
                free,
                3,
                steps=3,
                alpha=alpha,
            )
            assert 0 < ms < 10_000
        huge = CostModel({1: 1e6}, {1: 1e6})
        assert (
            measure_batch_overhead(target, draft, "chain", prompt, {"temperature": 0.0}, huge, 2, steps=2)
            == 0.0
        )


def test_batch_overhead_is_split_into_per_step_and_per_node(micro_pair, monkeypatch, fake_settling):
    """With many rows a tree's host work grows with its nodes (wider holey caches, per-node bookkeeping): the
    planner times the one-node chain and OVERHEAD_TREE and charges each candidate its share, so a chain is not
    billed for the wide tree's overhead (one figure from (2, 2, 1), charged to all, planned "no speculation" at
    every batch size > 1 on the tiny world)."""
    from resispec.decoding.planner import core as planner_mod

    seen = []

    def fake(target, draft, rule, prompt, sampling, cost, rows, tree=planner_mod.OVERHEAD_TREE, **kw):
        seen.append((rows, tuple(tree)))
        return 5.0 if tuple(tree) == (1,) else 5.0 + 3.0 * (max_tree_nodes(list(tree)) - 1)

    planned = []
    monkeypatch.setattr(planner_mod, "measure_batch_overhead", fake)
    real_rank = planner_mod.rank_trees
    monkeypatch.setattr(
        planner_mod,
        "rank_trees",
        lambda cost, alpha, **kw: planned.append(cost) or real_rank(cost, alpha, **kw),
    )
    target, draft = micro_pair
    with single_thread():
        planner = Planner(target, [[1, 2, 3, 4, 5, 6]], continuation_tokens=8)
        planner.choose_by_batch(draft, "chain", {"temperature": 0.0}, [1, 4])
    assert seen == [(4, (1,)), (4, planner_mod.OVERHEAD_TREE)]
    four = planned[1]
    assert four.overhead_ms == pytest.approx(2.0) and four.overhead_per_node_ms == pytest.approx(3.0)
    plain = CostModel(four.target_ms, four.draft_ms)
    for tree in ([1], [2, 2, 1], [4, 2, 1, 1]):
        assert four.step_ms(tree) - plain.step_ms(tree) == pytest.approx(2.0 + 3.0 * max_tree_nodes(tree))


def test_overhead_is_scaled_to_the_speed_of_the_tables(micro_pair, monkeypatch):
    """A step timed while the machine runs at half the speed the forward tables were measured at counts at the
    tables' speed: the one-token target forward timed between the steps gives the factor. The steps' clock is a
    fake one (each step 10 ms), so the two measurements differ by the factor alone, not by this machine's noise
    (with the real clock, a shared CPU once timed the same steps 2x apart and failed the bound)."""
    import itertools
    from types import SimpleNamespace

    from resispec.decoding.planner import cost as planner_mod

    clock = itertools.count(0.0, 0.005)  # two readings a step: each step takes 10 ms
    monkeypatch.setattr(planner_mod, "time", SimpleNamespace(perf_counter=lambda: next(clock)))

    cost = CostModel({1: 10.0}, {1: 1.0})
    assert planner_mod.drift(cost, [0.020, 0.021, 0.019]) == pytest.approx(0.5)
    assert planner_mod.drift(cost, []) == 1.0
    assert planner_mod.drift(CostModel({1: 0.0}, {1: 0.0}), [0.02]) == 1.0
    target, draft = micro_pair
    prompt = [1, 2, 3, 4, 5]
    tiny = CostModel({n: 1e-6 for n in NODES}, {n: 1e-6 for n in NODES})  # forwards predicted ~free
    with single_thread():
        # the reference forward timed at the tables' speed, then 4x slower: the same steps count a quarter
        monkeypatch.setattr(planner_mod.ForwardProbe, "seconds", lambda self, n=1: 1e-9)
        same = measure_batch_overhead(target, draft, "chain", prompt, {"temperature": 0.0}, tiny, 2, steps=4)
        monkeypatch.setattr(planner_mod.ForwardProbe, "seconds", lambda self, n=1: 4e-9)
        slow = measure_batch_overhead(target, draft, "chain", prompt, {"temperature": 0.0}, tiny, 2, steps=4)
    assert 0 < slow < same / 2


def test_overhead_leaves_out_the_prefill(micro_pair, monkeypatch):
    """measure_overhead times the steps after the first: the first carries the prompt's prefill on both models. A
    decoder whose first chunk takes 300 ms and every later step 10 ms measures 10 ms a step, not ~40. (On a clock
    the fake steps advance: slept, a loaded machine's oversleeping failed the test.)"""
    from resispec.decoding import SpeculativeDecoder
    from resispec.decoding.planner import cost as planner_mod
    from resispec.decoding.planner import measure_overhead
    from resispec.decoding.stats import DecodeStats

    now = [0.0]

    class Clock:  # planner_mod's `time`, with a perf_counter the fake steps advance
        perf_counter = staticmethod(lambda: now[0])

    def fake_stream(self, ids, **kwargs):
        self.last_stats = stats = DecodeStats()

        def steps():
            for i in range(10):
                now[0] += 0.3 if i == 0 else 0.01
                stats.num_drafts += 1
                yield [i]

        return steps()

    monkeypatch.setattr(planner_mod, "time", Clock)
    monkeypatch.setattr(SpeculativeDecoder, "generate_stream", fake_stream)
    monkeypatch.setattr(SpeculativeDecoder, "generate", lambda self, ids, **kw: None)
    target, draft = micro_pair
    free = CostModel({1: 0.0, 2: 0.0, 3: 0.0, 5: 0.0, 6: 0.0}, {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0})
    ms = measure_overhead(target, draft, "chain", [1, 2, 3], {"temperature": 0.0}, free)
    assert ms == pytest.approx(10.0)


# ------------------------------------------------------------------------------------------------ decode.tree=auto


def test_decode_config_tree_auto_and_validation():
    auto = DecodeConfig(tree="auto")
    assert auto.planned and auto.fixed_tree == list(DEFAULT_TREE)
    fixed = DecodeConfig(tree=[3, 1])
    assert not fixed.planned and fixed.fixed_tree == [3, 1]
    for bad in ("wide", [], [2, 0], [1.5], [True]):
        with pytest.raises(UserError, match="decode.tree"):
            DecodeConfig(tree=bad)


def test_bench_report_keeps_the_plan_table_with_start_up():
    """The bench's predicted-against-measured table of the tree=auto rows: the plan's figures as decoded on the
    calibration (the model's in brackets), the candidates decoded, and the planner's start-up, per plan and before
    any plan."""
    from resispec.benchmark.report import breakdown_markdown
    from resispec.benchmark.results import BenchRow

    ar = BenchRow("ar", 1.0, tau=1.0, speedup=1.0, stats={"planner_init_s": 1.25})
    plan = _plan([1, 1, 1], 150.0, 2.4)
    plan = replace(plan, measured=True, tau_model=2.6, speedup_model=1.62, startup_s=7.5, speedup=1.5)
    plan.candidates = [{"tree": [2, 1, 1], "speedup": 1.41}, {"tree": [1, 1, 1], "speedup": 1.5}]
    row = BenchRow(
        "spec", 1.0, "d", "resispec", "auto[1,1,1]", tau=2.35, speedup=1.46, stats={"plan": plan.as_dict()}
    )
    chain = BenchRow("spec", 1.0, "d", "resispec", "[1,1,1]", tau=2.3, speedup=1.52)
    wide = BenchRow("spec", 1.0, "d", "resispec", "[4,2,1]", tau=2.9, speedup=1.30)
    others = [  # not the planned row's rule, draft or temperature: never its best fixed row
        BenchRow("spec", 1.0, "d", "chain", "[1,1,1]", speedup=1.9),
        BenchRow("spec", 1.0, "e", "resispec", "[1,1,1]", speedup=1.8),
        BenchRow("spec", 0.0, "d", "resispec", "[1,1,1]", speedup=1.7),
    ]
    text = "\n".join(breakdown_markdown([ar, chain, wide, *others, row]))
    assert "| 1 | resispec auto[1,1,1] (d) | 2.40 (2.60) | 2.35 | 1.50 (1.62) | 1.46 " in text
    # the best fixed row of the same draft, rule and temperature; the planned tree is that very tree: (=)
    assert "| 1.46 | [1,1,1] 1.52 | 0.96 (=) | [2, 1, 1] 1.41x, [1, 1, 1] 1.50x | 7.5 s |" in text
    row.tree = "auto[2,1,1]"  # another tree than the best fixed row's: a plain ratio
    assert "| [1,1,1] 1.52 | 0.96 | [2, 1, 1]" in "\n".join(breakdown_markdown([ar, chain, wide, row]))
    assert "Planner start-up before any plan (the target's forward table): 1.2 s." in text
    row.stats["plan"] = replace(plan, tau=2.6, tau_decoded=2.4).as_dict()  # a chain at T > 0: the model's tau
    assert "| 2.60 (model; decoded 2.40) | 2.35 |" in "\n".join(breakdown_markdown([ar, chain, row]))


def test_a_draft_head_is_planned_by_decoding(micro_pair):
    """tree=auto for a draft head (issue 44): no cost or acceptance model (the head's forward reads the target's
    states), so every tree of HEAD_TREES is decoded with AR alongside at batch 1 (a chain wins ties, the winner
    re-measured), and a batched size settles batch 1's tree against the chain on real batched steps."""
    from resispec.decoding.planner import HEAD_TREES
    from resispec.models.head import DraftHead

    target, _ = micro_pair
    with single_thread():
        head = DraftHead.from_target(target, seed=0)
        planner = Planner(target, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], continuation_tokens=4)
        plans = planner.choose_by_batch(head, "resispec", {"temperature": 1.0}, [1, 2])
    one, two = plans[1], plans[2]
    assert one.measured and tuple(one.tree) in HEAD_TREES and one.tau_model is None
    assert [tuple(c["tree"]) for c in one.candidates] == list(HEAD_TREES)
    assert one.selected_speedup is not None and one.startup_s > 0 and "model" not in one.describe()
    assert two.measured and len(two.candidates) in (1, 2) and two.tree in ([1, 1, 1], one.tree)
