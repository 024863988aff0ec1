"""The speculation policy of the batched server (`server.speculation`: auto | always | never), step by step: whether
the rows of the next batch step draft, and which tree (docs/design.md "Batched decoding and scheduling"; the rule
in full is scheduler.py's module docstring).

- `StepCostModel`: one mode's recent pure steps -> predicted seconds per emitted token at any number of rows;
- `SpeculationPolicy`: the scheduler's base: the online cost models per mode, the start-up plan per batch-size
  bucket (decode.tree=auto), the choice with its hysteresis and probes (`_choose`), the measurement of a pure
  step's cycle (`_measure`), and `cost_table()` / `predicted_ratio()` for reports;
- `bucket(size)`: batch sizes share measurements by power-of-two bucket.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

EXPLORE_EVERY = 64  # every so many steps at a batch size, the other mode is measured again
# from AR to drafting only below this ratio (each switch feeds the draft what it skipped)
SWITCH_MARGIN = 0.95
# ... and below this one where the planner measured that speculation does not pay at that batch size: one step's
# time drifts by +-30% within a minute on a shared CPU, and at 16 rows the online model put drafting at parity
# (ratio 0.99-1.17) while timed steps said 1.15-1.25x dearer per token; it drafted 22-28% of its steps
AGAINST_PLAN_MARGIN = 0.85
# ... and it keeps drafting there only while below this one (not 1.0): at T = 0, 8 rows, the model put drafting at
# 0.88-0.96 after one dip below 0.85 and drafted 57% of the steps, while one process timing each mode alone found
# drafting 1.05-1.15x dearer per token and the planner 1.7x (the server gave 0.75x of batched AR's tokens/s)
AGAINST_PLAN_KEEP = 0.9
CLEAR_MARGIN = 1.5  # ... and 4x less often while the model's ratio is beyond this factor either way
WARMUP_EVERY = 6  # the probing period before the model is ready
PROBE_STEPS = 3  # steps of the other mode per measurement (the first drafting one pays the draft's catch-up)
COST_WINDOW = 32  # recent per-token costs per (mode, batch-size bucket), for cost_table()
# recent pure steps per mode and batch-size bucket that the cost model fits: kept per bucket, so that a load which
# stays at one batch size for a while does not wash out what the mode cost at the others (one window for all sizes
# held only 16-row AR steps after a minute at 16 clients: a flat line through them put an 8-row AR step at a 16-row
# step's cost, 1.2-1.5x the truth, and the policy saw drafting at half AR's cost per token at 8 rows)
MODEL_WINDOW = 64
# pure steps of each mode at a batch-size bucket before the model decides there instead of the plan
MIN_SAMPLES = 3
# a cycle this many times its mode's median cost per token at that batch size is a stall of the process, not a cost
# of the mode: one drafting cycle of 333-382 ms among 15-25 ms ones (the second request's first step, in most
# start-ups of `python serve/server.py`; a pause of the whole interpreter), counted into the mean, put drafting at
# 1.2-1.6x AR's cost per token and held the server on AR for its first ~1000 steps. The costs one mode pays now and
# then (a drafting step taking a long pending block) are 1.2-2.5x a step and stay in
STALL_FACTOR = 4.0
LOG_EVERY = 512  # batch steps between two INFO lines of the policy's state
SPECULATION = ("auto", "always", "never")  # lone requests: by measured cost, always speculative, never


class StepCostModel:
    """One mode's recent pure steps (rows, seconds, emitted tokens) -> predicted seconds per emitted token at any
    number of rows: the step's seconds as a line in the rows (least squares weighted towards the rows asked
    about, slope at least 0), over the tokens the rows emit per step (their mean per row). Means, not medians:
    the costs only one mode pays now and then (a drafting step whose rows owe the draft several tokens) are
    real, and a median would drop them."""

    def __init__(self, window: int = MODEL_WINDOW) -> None:
        self.window = window
        # batch-size bucket -> its recent steps (rows, seconds, tokens)
        self.by_bucket: dict[int, deque] = {}
        self._fits: dict[int, tuple[float, float, float]] = {}  # rows -> fit around them, until the next step
        self._array: np.ndarray | None = None  # the steps as [n, 3] floats, until the next step

    def __len__(self) -> int:
        return sum(len(steps) for steps in self.by_bucket.values())

    def add(self, rows: int, seconds: float, tokens: int) -> None:
        self.by_bucket.setdefault(bucket(rows), deque(maxlen=self.window)).append((rows, seconds, tokens))
        self._fits.clear()
        self._array = None

    @property
    def array(self) -> np.ndarray:
        """The steps as [n, 3] float64: rows, seconds, tokens."""
        if self._array is None:
            steps = [step for recent in self.by_bucket.values() for step in recent]
            self._array = np.asarray(steps, dtype=np.float64).reshape(-1, 3)
        return self._array

    def count_at(self, size: int) -> int:
        """Steps whose rows fall in batch-size bucket `size` (a bucket's top size, as bucket gives)."""
        return len(self.by_bucket.get(size, ()))

    def fit(self, rows: int | None = None) -> tuple[float, float, float]:
        """(intercept s, slope s per row, tokens per row per step); around `rows` when given: each step weighs
        a quarter as much per doubling of its rows away from them (one line does not fit 1 and 16 rows
        equally well). Vectorised: the policy refits every step (a Python loop over 96 steps cost ~150 us of a
        6-15 ms step)."""
        if rows not in self._fits:
            r, t, k = self.array.T
            w = np.ones_like(r) if rows is None else 0.25 ** np.abs(np.log2(r / rows))
            n = w.sum()
            mean_r, mean_t = (w * r).sum() / n, (w * t).sum() / n
            var = (w * (r - mean_r) ** 2).sum()
            cov = (w * (r - mean_r) * (t - mean_t)).sum()
            slope = max(0.0, float(cov / var)) if var > 1e-12 else 0.0
            self._fits[rows] = (float(mean_t - slope * mean_r), slope, float(k.sum() / r.sum()))
        return self._fits[rows]

    def per_token(self, rows: int) -> float:
        """Predicted seconds per emitted token of a step with `rows` rows."""
        intercept, slope, per_row = self.fit(rows)
        return max(intercept + slope * rows, 1e-9) / (rows * max(per_row, 1e-9))


def bucket(size: int) -> int:
    """Batch sizes share cost measurements by power-of-two bucket (1, 2, 3-4, 5-8, ...): the bucket's top size."""
    return 1 << max(0, size - 1).bit_length()


class SpeculationPolicy:
    """Draft or not, step by step, from measured costs (see the module docstring). `batched` is the engine's batched
    decoder (its `shape`: the engine's tree; `in_lockstep`); the plans map a batch-size bucket to its planned tree
    (None: do not speculate there); empty = the engine's tree everywhere."""

    def __init__(
        self, batched, speculation: str = "auto", trees_by_batch=None, greedy_trees_by_batch=None
    ) -> None:
        if speculation not in SPECULATION:
            raise ValueError(f"speculation must be one of {SPECULATION}, got {speculation!r}")
        self.batched, self.speculation = batched, speculation
        # batch-size bucket -> planned tree, None = do not speculate (decode.tree=auto); empty = the engine's tree.
        # Sampled rows' plan, and greedy rows' (planned at temperature 0; absent: the same plan)
        self.trees_by_batch = trees_by_batch or {}
        self.greedy_trees_by_batch = (
            self.trees_by_batch if greedy_trees_by_batch is None else greedy_trees_by_batch
        )
        # whether the last step's rows were all greedy (cost_table reports that plan)
        self._greedy_batch = False
        self.samples: dict[tuple[str, int], deque] = {}  # (mode, batch size) -> seconds per token
        # "ar", or (the drafted tree as a tuple, all rows greedy) -> that mode's cost model (greedy and sampled
        # rows accept differently: the tokens a step emits are part of the model)
        self.models: dict[Any, StepCostModel] = {}
        self.step_counts: dict[int, list[int]] = {}  # batch size -> [steps, steps in which every row drafted]
        # batch size -> the mode the policy last preferred (True: draft)
        self._preferred: dict[int, bool] = {}
        self._probing: dict[int, int] = {}  # batch size -> steps of the other mode still to take
        self.stalls = 0  # measured cycles left out of the cost model as stalls (STALL_FACTOR)

    def _policy_line(self) -> str:
        """bucket: drafted share of its steps, the model's ratio there (drafting / AR seconds per token)."""
        parts = []
        for size in sorted(self.step_counts):
            ratio, share = self.predicted_ratio(size, self._greedy_batch), self._drafted_share(size)
            parts.append(
                f"{size} rows: drafted {share:.0%}, ratio {'-' if ratio is None else format(ratio, '.2f')}"
            )
        if self.stalls:
            parts.append(f"stalls left out: {self.stalls}")
        return "; ".join(parts)

    def _plan(self, greedy: bool) -> dict:
        return self.greedy_trees_by_batch if greedy else self.trees_by_batch

    def tree_at(self, size: int, greedy: bool = False):
        """The tree speculative steps draft at this batch-size bucket: the planner's tree for the bucket (greedy
        rows' plan when `greedy`) when the engine was planned per batch size (`trees_by_batch`, decode.tree=auto),
        else True (the engine's tree). Where the plan says not to speculate, exploring steps draft a one-token
        chain, the cheapest speculation (the engine's batch-1 tree may be far dearer at many rows, and a probe's
        cost is paid whatever it shows)."""
        plan = self._plan(greedy)
        if size not in plan:
            return True
        planned = plan[size]
        return tuple(planned) if planned else (1,)

    def _plan_prefers_ar(self, size: int, greedy: bool = False) -> bool:
        plan = self._plan(greedy)
        return size in plan and not plan[size]

    def _choose(self, rows: int, greedy: bool = False) -> bool:
        """Draft this step, with `rows` rows (all greedy: `greedy`)? The adaptive policy (module docstring)."""
        if self.speculation != "auto":
            return self.speculation == "always"
        size = bucket(rows)
        steps = self.step_counts.get(size, (0, 0))[0] + 1  # counting this one
        # None until both modes were measured at this batch size: the plan was, and a model line drawn through other
        # sizes' steps does not overrule it (at 16 rows, T = 0, a model fitted on 1-8 rows put drafting at 0.85x AR
        # and the server drafted the first steps of a wave of 16 equal requests, which staggered them for good)
        ratio = self.predicted_ratio(rows, greedy) if self._measured_at(size, greedy) else None
        against_plan = self._plan_prefers_ar(size, greedy)
        if ratio is None:
            preferred = not against_plan
        else:  # hysteresis: near a ratio of 1 the noise would flip the mode, and each flip has a cost
            drafting = self._preferred.get(size, not against_plan)
            if against_plan:  # overruling the plan takes a clear answer, to start and to go on
                preferred = ratio < (AGAINST_PLAN_KEEP if drafting else AGAINST_PLAN_MARGIN)
            else:
                preferred = ratio < (1.0 if drafting else SWITCH_MARGIN)
        self._preferred[size] = preferred
        left = self._probing.get(size, 0)
        if left:
            self._probing[size] = left - 1
            return not preferred
        if ratio is None and against_plan:
            # the start-up plan measured that drafting does not pay here: trust it for EXPLORE_EVERY steps. Probed
            # at once, a 16-row first wave of equal requests drafted 6 of its first 12 steps, which staggered its
            # rows for good: the next waves came in one request per step and every row attended over the longest
            # row's columns (out of process, T = 1: 0.76-0.85x batched AR)
            due = steps % EXPLORE_EVERY == 0
        elif ratio is None:  # from a batch size's first step: the model needs steps of both modes
            due = steps % WARMUP_EVERY == 1
        else:  # a clear answer is re-checked less often (a drafting probe can cost 2-3 AR steps): a ratio beyond
            # CLEAR_MARGIN, or the model and the plan agreeing that speculation does not pay at this batch size.
            # Not at the size's first step: the model already answers there, and a probe there lands on a batch
            # that has just filled up (a drafting probe staggers rows that would have finished together)
            clear = max(ratio, 1 / ratio) > CLEAR_MARGIN or (against_plan and not preferred)
            due = steps % (EXPLORE_EVERY * (4 if clear else 1)) == 0
        if due and against_plan and self._in_lockstep():
            # a drafting probe would break the lockstep for good: rows accept different numbers of tokens, finish
            # at different steps, and the next requests join over several boundaries (steps with fewer rows, every
            # row attending over the longest row's columns). At 8 clients,
            # T = 0, the probes (4% of the steps) made the AR steps that followed 8% dearer per token than
            # batched AR's (out of process, 0.89x batched AR's tokens/s). A batch in lockstep (up to one step: the
            # clients' next requests reach the server a step apart) is not probed; one that is staggered already
            # loses nothing to the probe but its own steps
            due = False
        if due:  # the other mode, from the next step
            self._probing[size] = PROBE_STEPS
        return preferred

    def _in_lockstep(self) -> bool:
        """The batch's rows are in lockstep (BatchedSpeculativeDecoder.in_lockstep)."""
        return bool(getattr(self.batched, "in_lockstep", False))

    def _measure(self, drafted, rows: int, tokens: int, greedy: bool, seconds: float) -> None:
        """Record a pure step's cycle: `drafted` is False for an AR step, else the tree every row drafted; `greedy`:
        every row was greedy. A stall (STALL_FACTOR) is counted, not recorded."""
        mode = "spec" if drafted else "ar"
        recent = self.samples.setdefault((mode, bucket(rows)), deque(maxlen=COST_WINDOW))
        stall = (
            len(recent) >= MIN_SAMPLES and seconds / tokens > STALL_FACTOR * sorted(recent)[len(recent) // 2]
        )
        # the median follows every cycle: a machine that stays 4x slower is recorded again within COST_WINDOW / 2
        recent.append(seconds / tokens)
        if stall:
            self.stalls += 1
            log.debug("a %s cycle of %.1f ms at %d rows left out (a stall)", mode, 1e3 * seconds, rows)
            return
        self.models.setdefault(self._model_key(drafted, greedy), StepCostModel()).add(rows, seconds, tokens)

    def _model_key(self, drafted, greedy: bool = False) -> Any:
        """The cost model of AR steps ("ar") or of drafting this tree (the engine's tree when `drafted` is True)
        with greedy rows only or not."""
        if not drafted:
            return "ar"
        return (tuple(self.batched.shape) if drafted is True else tuple(drafted)), greedy

    def _measured_at(self, size: int, greedy: bool = False) -> bool:
        """Both modes' cost models hold MIN_SAMPLES pure steps at this batch-size bucket (drafting its tree)."""
        models = (self.models.get(self._model_key(self.tree_at(size, greedy), greedy)), self.models.get("ar"))
        return all(m is not None and m.count_at(size) >= MIN_SAMPLES for m in models)

    def predicted_ratio(self, rows: int, greedy: bool = False) -> float | None:
        """The cost model's drafting / AR seconds per emitted token at `rows` rows (all greedy: `greedy`),
        drafting the tree of their batch-size bucket; None until both modes have MIN_SAMPLES measured steps in
        that bucket (a line through other sizes' steps alone is an extrapolation, and a flat one when they all
        had one size)."""
        size = bucket(rows)
        if not self._measured_at(size, greedy):
            return None
        spec = self.models[self._model_key(self.tree_at(size, greedy), greedy)]
        return spec.per_token(rows) / self.models["ar"].per_token(rows)

    def cost(self, key: tuple[str, int]) -> float | None:
        """Median seconds per emitted token of (mode "spec" | "ar", batch size) over its recent steps; None before
        the first measurement."""
        samples = sorted(self.samples.get(key, ()))
        return samples[len(samples) // 2] if samples else None

    def cost_table(self) -> dict[int, dict[str, float | None]]:
        """Batch size bucket -> measured seconds per token of drafting and autoregressive steps (where speculation
        pays); the model's ratio and the tree are those of the last step's plan (greedy rows' or sampled rows')."""
        sizes = sorted({size for _, size in self.samples})
        return {
            b: {
                "spec": self.cost(("spec", b)),
                "ar": self.cost(("ar", b)),
                "ratio": self.predicted_ratio(b, self._greedy_batch),
                "tree": self._tree_label(b),
                "drafted": self._drafted_share(b),
            }
            for b in sizes
        }

    def _drafted_share(self, size: int) -> float | None:
        """The share of the batch steps at this batch-size bucket in which every row drafted."""
        steps, drafted = self.step_counts.get(size, (0, 0))
        return drafted / steps if steps else None

    def _tree_label(self, size: int) -> list[int]:
        return list(self._model_key(self.tree_at(size, self._greedy_batch))[0])
