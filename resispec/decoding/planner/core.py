"""The Planner: one target on this device, its cost tables measured once, one calibration per (draft, rule,
sampling); used by the bench (tree=auto rows) and the server (decode.tree=auto). See the package docstring."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import torch

from resispec.decoding.planner.acceptance import (
    greedy_alpha,
    greedy_continuations,
    greedy_hit_sets,
    greedy_tau,
    sampled_alpha,
    sampled_continuations,
)
from resispec.decoding.planner.cost import (
    BATCH_NODE_GRID,
    NODE_GRID,
    OVERHEAD_TREE,
    CostModel,
    forward_table,
    measure_batch_overhead,
    measure_overhead,
    measure_verify_ms,
    measure_verify_row_ms,
    monotone,
)
from resispec.decoding.planner.search import HEAD_TREES, Plan, rank_trees, unranked
from resispec.decoding.planner.settle import (
    BATCH_SETTLE_MOST,
    BATCH_SETTLE_ROUNDS,
    SETTLE_PROMPTS,
    SETTLE_TOKENS,
    BatchedCalibrationDecodes,
    CalibrationDecodes,
    settle_by_decoding,
)
from resispec.decoding.tree import max_tree_nodes
from resispec.models.head import is_head
from resispec.sampling import is_greedy, probs
from resispec.verify import build_rule

# the calibration continuations' seeds at T > 0: prompt i draws from CONTINUATION_SEED + i
CONTINUATION_SEED = 10_000
# T > 0: alpha is calibrated on the first ALPHA_PROMPTS prompts' sampled continuations. Four (SETTLE_PROMPTS, before)
# put a distilled chain's tau 8% above 96 prompts' on the tiny world (run AY: [1]*5 3.38 against 3.13; blocks of 4
# prompts spread alpha(1) by 0.02 a block); 24 came within 0.5%, for about 3 s a plan (docs/decoder_speed.md)
ALPHA_PROMPTS = 24
# Monte Carlo runs a node where a rule has no closed form (resispec_auto at n >= 2): ALPHA_SAMPLES over the prompts
# (64 a node on 4 prompts, as before: the Monte Carlo cost stays), at least ALPHA_SAMPLES_MIN
ALPHA_SAMPLES, ALPHA_SAMPLES_MIN = 256, 8


class Planner:
    """Plans trees for one target on this device: the cost model measured once, the target's own continuations
    of the calibration prompts generated once per sampling setting, one calibration per (draft, rule, sampling)
    asked for. Used by the bench (tree=auto rows) and by the server (decode.tree=auto).

    `prompts`: the first SETTLE_PROMPTS settle the near-ties (round r decodes prompt r); the winner's fresh
    re-measure (REMEASURE_PASSES x as many rounds) decodes the prompts after them, cycling, so with at least 3 x
    SETTLE_PROMPTS prompts the prediction's decodes come from 8 prompts that took no part in choosing the tree:
    prompts differ in how well the draft follows them, and a prediction from the prompts that chose the tree
    inherits their luck. At T = 0 every prompt counts tau (greedy_tau), which costs no decode: the defaults pass
    96: a greedy draft's tau spreads by about a quarter of its mean from prompt to prompt (the tiny world's
    distilled chain: 0.66 around 2.77), so 96 prompts leave its mean about 2.4% uncertain, 48 about 3.4% (their
    first 48 counted 2.67, all 96 2.77), and a tree ratio moves less (docs/decoder_speed.md). At T > 0 the first
    ALPHA_PROMPTS calibrate alpha on continuations sampled from the target."""

    def __init__(
        self, target: torch.nn.Module, prompts: Sequence[Sequence[int]], continuation_tokens: int = 32
    ):
        if not prompts:
            raise ValueError("the planner needs at least one calibration prompt")
        self.target, self.prompts = target, [list(p) for p in prompts]
        self.calibration = self.prompts[:SETTLE_PROMPTS]  # the settling rounds
        self.continuation_tokens = continuation_tokens
        self._ms: dict[tuple[int, int], dict[int, float]] = {}  # (id(model), batch) -> ms by tokens per row
        t0 = time.perf_counter()
        self._table(target, 1)  # the target's batch-1 costs now, before any calibration
        self.init_s = time.perf_counter() - t0  # start-up spent here, before any plan
        self._continuations: dict[tuple, list[list[int]]] = {}
        self._greedy: tuple | None = None  # every prompt's greedy continuation and target argmax
        self._hits: tuple | None = None  # (draft, its greedy hits): _greedy_hit_sets
        # start-up spent once on the target's greedy continuations (the first plan at T = 0), outside its startup_s
        self.greedy_s = 0.0

    def _table(self, model: torch.nn.Module, batch: int) -> dict[int, float]:
        key = (id(model), batch)
        if key not in self._ms:  # larger batches: a shorter grid and fewer rounds (start-up time)
            nodes = NODE_GRID if batch == 1 else BATCH_NODE_GRID
            between = None if model is self.target else self.target  # a draft: timed as in a decode step
            table = forward_table(model, nodes, reps=7 if batch == 1 else 4, batch=batch, between=between)
            self._ms[key] = monotone(table)
        return self._ms[key]

    def cost_for(self, draft: torch.nn.Module, batch: int = 1) -> CostModel:
        """Target and `draft` forward times on this device with `batch` rows (each measured once)."""
        return CostModel(self._table(self.target, batch), self._table(draft, batch))

    def costs(self, drafts: dict) -> dict[str, CostModel]:
        return {label: self.cost_for(d) for label, d in drafts.items()}

    def _sequences(self, settings: dict) -> list[list[int]]:
        """The first ALPHA_PROMPTS prompts, each with the target's continuation sampled under `settings` (EOS
        ignored, prompt i seeded CONTINUATION_SEED + i): the positions alpha is calibrated on at T > 0. Once per
        setting."""
        key = tuple(sorted(settings.items()))
        if key not in self._continuations:
            self._continuations[key] = sampled_continuations(
                self.target,
                self.prompts[:ALPHA_PROMPTS],
                self.continuation_tokens,
                settings,
                CONTINUATION_SEED,
            )
        return self._continuations[key]

    def _greedy_sequences(self) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Every prompt (all of them, not only the calibration's) with the target's greedy continuation of
        SETTLE_TOKENS tokens (greedy_continuations: the tokens a settling decode of that prompt emits at
        temperature 0). Once a planner. Target-only work, as the forward table: its seconds go to greedy_s, not to
        the plan that asked first."""
        if self._greedy is None:
            t0 = time.perf_counter()
            self._greedy = greedy_continuations(self.target, self.prompts, SETTLE_TOKENS)
            self.greedy_s = time.perf_counter() - t0
        return self._greedy

    def _greedy_hit_sets(self, draft: torch.nn.Module) -> list[torch.Tensor]:
        """Temperature 0: each prompt's greedy_hits along its greedy continuation (greedy_hit_sets), from which
        greedy_tau counts any tree's tau as the decoder would. The last draft's are kept (a bench plans each draft
        for two rules in turn)."""
        if self._hits is None or self._hits[0] is not draft:
            hits = greedy_hit_sets(self.target, draft, self.prompts, self._greedy_sequences())
            self._hits = draft, hits
        return self._hits[1]

    def choose(self, draft: torch.nn.Module, rule: str, sampling: dict, auto_policy=None) -> Plan:
        """The planned tree of `rule` (a VERIFIERS key) for `draft` under `sampling` (temperature, top_k, top_p)."""
        return self.choose_by_batch(draft, rule, sampling, (1,), auto_policy)[1]

    def choose_by_batch(
        self,
        draft: torch.nn.Module,
        rule: str,
        sampling: dict,
        batch_sizes: Sequence[int],
        auto_policy=None,
        threads_at=None,
    ) -> dict[int, Plan]:
        """The planned tree of `rule` for `draft` at each batch size (the batched decoder: every row drafts its
        tree, one draft forward per depth and one target forward for all rows). The acceptance is per row, so
        one calibration serves every size; the forward times are measured at each size, and the per-row host
        work is measured at each size (measure_batch_overhead) and the verification scales with the rows. The model
        ranks the candidates; batch 1, and every size where the model plans speculation, is then settled on real
        decodes of the calibration prompts (settle_by_decoding: the near-ties and the best chain, AR alongside; a
        chain wins ties), so those plans' tau and speedup are measured. A plan whose speedup is at most 1 says: at
        this batch size, do not speculate. Each plan's startup_s: the seconds this call spent on it (the shared
        calibration included; the target's greedy continuations, computed by the planner's first call at T = 0,
        in greedy_s instead). `threads_at` (batch size -> torch threads; None: torch's setting): each size is
        timed on the threads it will decode on."""
        initial_threads = torch.get_num_threads()
        try:
            return self._choose_by_batch(draft, rule, sampling, batch_sizes, auto_policy, threads_at)
        finally:
            torch.set_num_threads(initial_threads)

    def _choose_by_batch(
        self, draft, rule, sampling, batch_sizes, auto_policy, threads_at
    ) -> dict[int, Plan]:
        def on_threads_of(batch: int) -> None:
            if threads_at is not None:
                torch.set_num_threads(threads_at(batch))

        t_start, greedy_before = time.perf_counter(), self.greedy_s
        settings = {k: sampling[k] for k in ("temperature", "top_k", "top_p") if k in sampling}
        rule_obj = build_rule(rule, auto_policy)  # the rule the decoder runs (resispec_auto: with its policy)
        on_threads_of(1)  # the verification timings and the batch-1 forward table
        head = is_head(draft)
        cost, alpha, tau_of = (None, None, None) if head else self._calibrate(draft, rule_obj, settings)
        plans: dict[int, Plan] = {}
        # the calibration and verification timings serve every size (the target's greedy continuations, once a
        # planner, are not this plan's: greedy_s)
        shared_s = time.perf_counter() - t_start - (self.greedy_s - greedy_before)
        for b in batch_sizes:
            t_b = time.perf_counter()
            on_threads_of(b)
            if head:
                plans[b] = self._settle_head(draft, rule_obj, settings, b, plans.get(1))
            else:
                plans[b] = self._plan_at(b, draft, rule_obj, settings, cost, alpha, tau_of)
            plans[b].startup_s = shared_s + time.perf_counter() - t_b
        return plans

    def acceptance(
        self, draft: torch.nn.Module, rule: str, sampling: dict, auto_policy=None
    ) -> dict[int, float]:
        """alpha by number of draws of `rule` for `draft` under `sampling`, calibrated as choose() calibrates it
        (the product model's input: expected_tau(tree, alpha))."""
        settings = {k: sampling[k] for k in ("temperature", "top_k", "top_p") if k in sampling}
        if is_greedy(settings.get("temperature", 1.0)):
            return greedy_alpha(self._greedy_hit_sets(draft))
        return self._alpha(draft, build_rule(rule, auto_policy), settings)[0]

    def _alpha(self, draft, rule_obj, settings: dict) -> tuple[dict[int, float], tuple]:
        """alpha over the first ALPHA_PROMPTS prompts' sampled continuations (sampled_alpha: every node alike; as
        many Monte Carlo runs in all as 4 prompts of 64 a node), and the first prompt's (target, draft) node
        logits."""
        seqs = self._sequences(settings)
        starts = [len(p) for p in self.prompts[: len(seqs)]]
        samples = max(ALPHA_SAMPLES_MIN, ALPHA_SAMPLES // len(seqs))
        return sampled_alpha(self.target, draft, seqs, starts, rule_obj, settings, samples=samples)

    def _calibrate(
        self, draft, rule_obj, settings: dict
    ) -> tuple[CostModel, dict[int, float], Callable | None]:
        """The batch-1 cost model (verification timed on the calibration's own nodes at T > 0), alpha, and at
        T = 0 tau_of(tree): greedy_tau over every prompt's greedy continuation, the decoder's exact count, where
        the product model would multiply hit rates as if depths were independent (a greedy draft's misses come in
        runs) and the calibration prompts alone are few (docs/decoder_speed.md)."""
        cost = self.cost_for(draft)
        if is_greedy(settings.get("temperature", 1.0)):
            hit_sets = self._greedy_hit_sets(draft)
            return cost, greedy_alpha(hit_sets), functools.partial(greedy_tau, hit_sets=hit_sets)
        # the prompts' nodes once: the calibration scores them, and the first prompt's time the verification
        alpha, (t_logits, d_logits) = self._alpha(draft, rule_obj, settings)
        vocab = min(self.target.config.vocab_size, draft.config.vocab_size)
        device = next(draft.parameters()).device
        # timed on the calibration's own nodes (the first prompt's): the cost depends on the distributions
        nodes = probs(t_logits, **settings), probs(d_logits, **settings)
        cost.verify_ms = measure_verify_ms(rule_obj, vocab, max(alpha), device=device, nodes=nodes)
        cost.verify_row_ms = measure_verify_row_ms(rule_obj, vocab, device=device, nodes=nodes)
        # the first call of a step follows the target's forward: timed that way, its extra over a one-draw one
        cold = measure_verify_ms(rule_obj, vocab, max(alpha), device=device, nodes=nodes, between=self.target)
        base = cold[1] - cost.verify_ms[1]
        cost.root_verify_extra_ms = {n: max(cold[n] - cost.verify_ms[n] - base, 0.0) for n in cold}
        return cost, alpha, None

    def _plan_at(
        self, b: int, draft, rule_obj, settings: dict, cost: CostModel, alpha: dict, tau_of: Callable | None
    ) -> Plan:
        """The plan at batch size b: the model ranks (forwards and host overhead timed at b; tau: `tau_of`'s at
        T = 0, else the product model's), then batch 1, and every size where the model plans speculation, is
        settled on real decodes."""
        at_b = self.cost_for(draft, b)
        at_b.verify_ms = {n: ms * b for n, ms in cost.verify_ms.items()}
        at_b.verify_row_ms = cost.verify_row_ms * b
        at_b.root_verify_extra_ms = dict(cost.root_verify_extra_ms)  # once a step (the first row's call)
        at_b.chain_walk_in_overhead = b > 1 and getattr(rule_obj, "one_draw_is_standard", False)
        # per step and per node: timed with the one-node chain and a wider tree
        measure = measure_overhead if b == 1 else functools.partial(measure_batch_overhead, rows=b)
        small, wide = (
            measure(self.target, draft, rule_obj, self.prompts[0], settings, at_b, tree=tree, alpha=alpha)
            for tree in ((1,), OVERHEAD_TREE)
        )
        at_b.overhead_per_node_ms = max(wide - small, 0.0) / (max_tree_nodes(list(OVERHEAD_TREE)) - 1)
        at_b.overhead_ms = max(small - at_b.overhead_per_node_ms, 0.0)
        ranked = rank_trees(at_b, alpha, tau_of=tau_of)
        # the plans whose tau is the model's in the settling (settle.as_measured), their decoded tau over a few
        # calibration decodes being the noisier estimate: at T > 0 a chain's, at T = 0 every plan's (exact)
        tau_from_model = "chains" if tau_of is None else "all"
        if b == 1:  # always settled on real decodes: the candidates and the best chain, AR alongside
            decode = CalibrationDecodes(self.target, draft, rule_obj, self.prompts, settings)
            return settle_by_decoding(ranked, decode, self._rounds(), tau_from_model=tau_from_model)
        if ranked[0].speedup > 1.0:  # speculation planned at this size: settled on real batched steps
            decode = BatchedCalibrationDecodes(self.target, draft, rule_obj, self.prompts, settings, rows=b)
            return settle_by_decoding(
                ranked, decode, BATCH_SETTLE_ROUNDS, most=BATCH_SETTLE_MOST, tau_from_model=tau_from_model
            )
        # the model says do not speculate here: left to it (and to the scheduler's online model)
        return ranked[0]

    def _rounds(self) -> int:
        return max(2, len(self.calibration))

    def _settle_head(self, head, rule_obj, settings: dict, b: int, at_one: Plan | None) -> Plan:
        """A draft head's plan at batch size b, decoded only: its forward reads the target's states, so the cost
        and acceptance models (a causal LM's forwards and logits) do not apply. Batch 1: every tree of
        HEAD_TREES decoded on the calibration prompts with AR alongside (settle_by_decoding; a chain wins ties,
        the winner re-measured); b > 1: batch 1's tree and the best chain on real batched steps (a speedup at
        most 1: do not speculate at this size)."""
        if b == 1 or at_one is None:
            decode = CalibrationDecodes(self.target, head, rule_obj, self.prompts, settings)
            ranked = unranked(HEAD_TREES)
            return settle_by_decoding(ranked, decode, self._rounds(), most=len(ranked))
        chain = at_one.tree if at_one.is_chain else next(list(t) for t in HEAD_TREES if set(t) == {1})
        ranked = unranked([at_one.tree, chain] if chain != at_one.tree else [chain])
        decode = BatchedCalibrationDecodes(self.target, head, rule_obj, self.prompts, settings, rows=b)
        return settle_by_decoding(ranked, decode, BATCH_SETTLE_ROUNDS, most=len(ranked))
