"""Candidate search: every per-depth branching within the node budget, ranked by the cost and acceptance models' predicted tokens per second (rank_trees). See the package docstring."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from resispec.decoding.planner.acceptance import expected_tau
from resispec.decoding.planner.cost import CostModel
from resispec.decoding.tree import max_tree_nodes


@dataclass
class Plan:
    tree: list[int]
    tau: float  # accepted length: predicted by the model, or measured on the calibration decodes (`measured`)
    step_ms: float
    tokens_per_s: float
    speedup: float  # over AR of the same target on this device: predicted, or measured alongside (`measured`)
    alpha: dict[int, float] = field(
        default_factory=dict
    )  # the calibrated per-node acceptance it was planned with
    # tau, step, tokens per second and speedup measured on real decodes of the calibration prompts
    # (settle_by_decoding), not predicted; the model's own figures stay in tau_model and speedup_model
    measured: bool = False
    tau_stderr: float | None = None  # of the measured tau, over its decode steps
    tau_model: float | None = None
    speedup_model: float | None = None
    # every candidate decoded when this plan was settled: tree, tau_model, tau, speedup_model, speedup, tokens
    candidates: list[dict] = field(default_factory=list)
    startup_s: float = 0.0  # wall seconds of the planning call that chose it (Planner.choose_by_batch)
    # its tau and speedup in the settling rounds that chose it (settle_by_decoding); tau and speedup are then
    # re-measured on fresh rounds (the winner of near-ties is the luckiest: its selection figures are biased up)
    selected_tau: float | None = None
    selected_speedup: float | None = None
    # a chain at T > 0, any tree at T = 0: tau is the model's (settle_by_decoding's tau_from_model) and this the
    # decoded one
    tau_decoded: float | None = None

    @property
    def is_chain(self) -> bool:
        return set(self.tree) <= {1}

    def describe(self) -> str:
        if not self.measured:
            return (
                f"tree={self.tree} predicted tau {self.tau:.2f}, step {self.step_ms:.1f} ms, "
                f"{self.tokens_per_s:.0f} tok/s, speedup {self.speedup:.2f}x over AR"
            )
        decoded = ", ".join(f"{c['tree']} {c['speedup']:.2f}x" for c in self.candidates)
        tau_model = "" if self.tau_model is None else f" (model {self.tau_model:.2f})"
        if self.tau_decoded is not None:
            tau_model = f" (the model's; decoded {self.tau_decoded:.2f})"
        speedup_model = "" if self.speedup_model is None else f" (model {self.speedup_model:.2f}x)"
        chosen_at = "" if self.selected_speedup is None else f", chosen at {self.selected_speedup:.2f}x"
        return (
            f"tree={self.tree} measured on calibration: tau {self.tau:.2f}{tau_model}, step {self.step_ms:.1f} "
            f"ms, speedup {self.speedup:.2f}x over AR{speedup_model} on fresh rounds{chosen_at}; "
            f"decoded {decoded}; start-up {self.startup_s:.1f} s"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def candidate_trees(max_nodes: int = 32, max_depth: int = 6, max_branch: int = 4) -> list[list[int]]:
    """Per-depth branchings, non-increasing with depth, at most `max_nodes` nodes (chains included)."""
    out = []
    for depth in range(1, max_depth + 1):
        for tree in itertools.product(range(1, max_branch + 1), repeat=depth):
            if all(a >= b for a, b in itertools.pairwise(tree)) and max_tree_nodes(list(tree)) <= max_nodes:
                out.append(list(tree))
    return out


def rank_trees(
    cost: CostModel,
    alpha: dict[int, float],
    candidates: Sequence[Sequence[int]] | None = None,
    tau_of: Callable[[Sequence[int]], float] | None = None,
) -> list[Plan]:
    """Every candidate tree's plan, the highest predicted tokens per second first (module docstring); ties keep
    the candidates' order (shallower and narrower first). `tau_of(tree)`: its tau where the caller has a better
    figure than the product model's (at temperature 0, the exact greedy_tau over the calibration continuations)."""
    ar_tps = 1e3 / cost.target(1)
    plans = []
    usable = [t for t in (candidates or candidate_trees(max_branch=max(alpha))) if all(b in alpha for b in t)]
    for tree in usable:
        tau = tau_of(tree) if tau_of is not None else expected_tau(tree, alpha)
        ms = cost.step_ms(tree) + cost.verify_cost(tree, alpha)
        tps = 1e3 * tau / ms
        plans.append(Plan(list(tree), tau, ms, tps, tps / ar_tps, dict(alpha)))
    plans.sort(key=lambda plan: -plan.tokens_per_s)
    assert plans and math.isfinite(plans[0].tokens_per_s)
    return plans


def plan_tree(
    cost: CostModel, alpha: dict[int, float], candidates: Sequence[Sequence[int]] | None = None
) -> Plan:
    """The candidate tree with the highest predicted tokens per second (module docstring; rank_trees)."""
    return rank_trees(cost, alpha, candidates)[0]


# a draft head's candidates (no cost or acceptance model: each is decoded, Planner._settle_head): chains of 3-5 and
# a few trees with a wider root, where a head's first-depth guess is the least sure
HEAD_TREES = ((1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1, 1), (2, 1, 1), (3, 2, 1))


def unranked(trees: Sequence[Sequence[int]]) -> list[Plan]:
    """Candidate plans with no model figures (tau, step, speedup NaN; tokens per second 0, so every one falls in
    settle_candidates' band): settle_by_decoding measures them all."""
    return [Plan(list(t), math.nan, math.nan, 0.0, math.nan) for t in trees]
