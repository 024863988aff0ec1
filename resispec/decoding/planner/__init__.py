"""The tree planner: pick the draft tree that maximises expected tokens per second on THIS device and pair.

    cost = measure_costs(target, draft)                       # ms per forward vs tokens fed, this device
    alpha = calibrate_alpha(target, draft, prompts, rule, settings)   # per-node acceptance vs number of draws
    plan = plan_tree(cost, alpha)                             # Plan(tree, tau, speedup, ...)

Model (Sequoia's idea restricted to per-depth branching): a tree [b_1, ..., b_D] accepts depth d with probability
prod_{j <= d} alpha(b_j), so the expected accepted length is tau = 1 + sum_d prod_{j <= d} alpha(b_j); one step
costs the draft forwards (depth 0 feeds one token, depth d < D feeds the b_1 ... b_d nodes of level d), the target
forward over all 1 + sum_d prod_{j <= d} b_j nodes, and a measured host overhead (per step; with many rows, per
tree node too). Speedup = tau / step time, over the AR cost of one target token. A chain is one candidate among
the others: where chains pay more, the planner returns a chain. alpha is measured per number of draws at held-out
positions of the target's own continuations (closed form where the rule has one, else Monte Carlo through the
rule's propose/verify). At temperature 0 tau is not multiplied but counted: the decoder then emits the target's
greedy continuation and drafts each node's top-b, so walking one teacher-forced forward's hits (the target's
argmax among the draft's top b at each position) along each prompt's greedy continuation gives every tree's tau
as the decoder's own count (greedy_tau; equal to the decodes' in the tests), over all the planner's prompts.

The model only shortlists: its tau multiplies per-depth acceptances as if depths were independent, which is optimistic
at T > 0 for any tree with a multi-draw level (the tiny world: [2,2,1] predicted tau 2.90, decoded 2.53), and its step
adds up parts that rank the top candidates, often within 1-2% of each other, wrongly. So the plans predicted within
SETTLE_BAND of the best (at most SETTLE_MOST), and always the best-ranked plain chain of the same rule, are DECODED
for real on the calibration prompts (settle_by_decoding): one generation per prompt each, the same seeded draws for
every candidate, AR in the same rounds, ABBA order. Their tau and tokens per second are measured, not predicted (but
at T > 0 a chain's tau is the model's, its decoded speedup scaled to it: a chain draws once a level, so the product
model is its expectation, and a few decodes are the noisier estimate; at T = 0 every candidate's tau is greedy_tau's
over all the prompts; settle.as_measured), and a tree must beat the chain by TIE_MARGIN (or by TIE_Z standard errors
of the measured taus' difference, if more) to be chosen: a chain wins ties. Batched buckets where the model plans
speculation are settled the same way on a few real batched steps. Each candidate's speedup is its ratio of sums to AR,
as the bench's, without its highest- and lowest-ratio rounds (one decode caught by another process's burst does not
pick the tree). The winner is decoded again with AR on REMEASURE_PASSES x as many FRESH rounds (other seeds, and the
calibration prompts after the first SETTLE_PROMPTS), beside the best chain when the winner is a tree, else the
settling's runner-up (FINALISTS in all): the fastest there is kept (a tree must beat the chain again; a chain wins
ties), and its figures there are the plan's prediction, since the winner of near-ties is the luckiest and its
selection figures are biased up (the winner's curse).

A draft head (its forward reads the target's states; no cost or acceptance model) is planned by decoding only:
every tree of HEAD_TREES at batch 1, batch 1's tree against the chain at larger sizes (Planner._settle_head).

Modules: cost (the cost model and its timings), acceptance (alpha and the product model's tau), search (candidate
trees ranked by the models), settle (real decodes of the near-ties; a chain wins ties), core (Planner).
"""

from resispec.decoding.planner.acceptance import (
    MAX_DRAWS,
    calibrate_alpha,
    expected_tau,
    greedy_alpha,
    greedy_continuations,
    greedy_hit_sets,
    greedy_hits,
    greedy_tau,
    greedy_walk,
    hits_of,
    node_logits,
    sampled_alpha,
    sampled_continuations,
    teacher_forced_logits,
    teacher_forced_top,
)
from resispec.decoding.planner.core import ALPHA_PROMPTS, Planner
from resispec.decoding.planner.cost import (
    BATCH_NODE_GRID,
    NODE_GRID,
    OVERHEAD_TREE,
    CostModel,
    ForwardProbe,
    forward_table,
    measure_batch_overhead,
    measure_costs,
    measure_overhead,
    measure_step_ms,
    measure_verify_ms,
    measure_verify_row_ms,
    monotone,
)
from resispec.decoding.planner.search import (
    HEAD_TREES,
    Plan,
    candidate_trees,
    plan_tree,
    rank_trees,
    unranked,
)
from resispec.decoding.planner.settle import (
    BATCH_SETTLE_MOST,
    BATCH_SETTLE_ROUNDS,
    BATCH_SETTLE_STEPS,
    FINALISTS,
    REMEASURE_PASSES,
    SETTLE_BAND,
    SETTLE_MOST,
    SETTLE_PROMPTS,
    SETTLE_SEED,
    SETTLE_TOKENS,
    TIE_MARGIN,
    TIE_Z,
    BatchedCalibrationDecodes,
    CalibrationDecodes,
    Decoded,
    pick_measured,
    settle_by_decoding,
    settle_candidates,
    tie_margin,
)

__all__ = [
    "ALPHA_PROMPTS",
    "BATCH_NODE_GRID",
    "BATCH_SETTLE_MOST",
    "BATCH_SETTLE_ROUNDS",
    "BATCH_SETTLE_STEPS",
    "BatchedCalibrationDecodes",
    "CalibrationDecodes",
    "CostModel",
    "FINALISTS",
    "HEAD_TREES",
    "MAX_DRAWS",
    "Decoded",
    "ForwardProbe",
    "NODE_GRID",
    "OVERHEAD_TREE",
    "Plan",
    "Planner",
    "REMEASURE_PASSES",
    "SETTLE_BAND",
    "SETTLE_MOST",
    "SETTLE_PROMPTS",
    "SETTLE_SEED",
    "SETTLE_TOKENS",
    "TIE_MARGIN",
    "TIE_Z",
    "calibrate_alpha",
    "candidate_trees",
    "expected_tau",
    "forward_table",
    "greedy_alpha",
    "greedy_continuations",
    "greedy_hit_sets",
    "greedy_hits",
    "greedy_tau",
    "greedy_walk",
    "hits_of",
    "measure_batch_overhead",
    "measure_costs",
    "measure_overhead",
    "measure_step_ms",
    "measure_verify_ms",
    "measure_verify_row_ms",
    "monotone",
    "node_logits",
    "pick_measured",
    "plan_tree",
    "rank_trees",
    "sampled_alpha",
    "sampled_continuations",
    "settle_by_decoding",
    "settle_candidates",
    "teacher_forced_logits",
    "teacher_forced_top",
    "tie_margin",
    "unranked",
]
