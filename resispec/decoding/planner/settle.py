"""Decode settling: the near-tied candidates and the best chain decoded for real on the calibration prompts
(settle_by_decoding), a chain winning ties (pick_measured). See the package docstring."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from resispec.decoding.batch import BatchedSpeculativeDecoder
from resispec.decoding.engine import SpeculativeDecoder
from resispec.decoding.planner.cost import sync_device
from resispec.decoding.planner.search import Plan
from resispec.sampling import is_greedy

# the plans predicted within SETTLE_BAND of the best (at most SETTLE_MOST) and the best-ranked chain are decoded on
# the calibration prompts (settle_by_decoding): batch 1, SETTLE_TOKENS tokens on each of SETTLE_PROMPTS prompts
SETTLE_BAND, SETTLE_MOST, SETTLE_PROMPTS, SETTLE_TOKENS = 0.08, 4, 4, 48
# batched buckets where the model plans speculation: fewer candidates, BATCH_SETTLE_STEPS steps a round
BATCH_SETTLE_MOST, BATCH_SETTLE_ROUNDS, BATCH_SETTLE_STEPS = 2, 2, 8
# a tree is chosen over the best measured chain only when it measures more than this much faster (a chain wins
# ties): the chain's step is the cheapest and its tau the least exposed to the calibration prompts' luck
TIE_MARGIN = 0.02
# ... or by TIE_Z standard errors of the two measured taus' relative difference, if more: at T = 1 four 48-token
# decodes leave tau ~5% noisy (the micro world: a chain's calibration tau 11% below its held-out one), and a tree
# picked on noise can lose more than the margin
TIE_Z = 1.0
# the winner's prediction: it, the best chain (a tree won) and AR decoded again on REMEASURE_PASSES x the
# settling rounds, fresh seeds (and, with 12 Planner prompts or more, 8 prompts that did not choose it); at T = 1
# tau over four 48-token decodes moves ~10% between seed sets, and two passes halve the variance
# (docs/decoder_speed.md)
REMEASURE_PASSES = 2
# ... beside the next fastest candidates of the settling, FINALISTS decoders in all (AR apart): the fastest on the
# fresh rounds is kept (a tree over a chain by pick_measured's margin). Two: the winner and the best chain (a tree
# won) or the runner-up. A third rarely won once a chain at T > 0 took the model's tau, and cost a seventh of the
# start-up (the runs behind it: docs/decoder_speed.md)
FINALISTS = 2
SETTLE_SEED = (
    20_000  # the seeds of the settling decodes: round r draws from SETTLE_SEED + r, every candidate alike
)


@dataclass
class Decoded:
    """Real decodes of one candidate (a tree, or None: AR): tokens emitted, speculative steps (row-steps in a
    batch), draft tokens accepted in them and the sum of their squares (tau's standard error), wall seconds."""

    tokens: int = 0
    steps: int = 0
    accepted: int = 0
    seconds: float = 0.0
    accepted_sq: int = 0

    def __add__(self, other: Decoded) -> Decoded:
        return Decoded(
            self.tokens + other.tokens,
            self.steps + other.steps,
            self.accepted + other.accepted,
            self.seconds + other.seconds,
            self.accepted_sq + other.accepted_sq,
        )

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 1.0

    @property
    def tau_stderr(self) -> float:
        """tau's standard error over the steps (taken as independent); 0 below two steps."""
        n = self.steps
        if n < 2:
            return 0.0
        mean = self.accepted / n
        return math.sqrt(max(self.accepted_sq / n - mean * mean, 0.0) / (n - 1))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def settle_candidates(
    ranked: Sequence[Plan], band: float = SETTLE_BAND, most: int = SETTLE_MOST
) -> list[Plan]:
    """The plans to decode for real: those predicted within `band` of the first (at most `most` of them), and the
    best-ranked plain chain, always (appended when the model ranked it outside)."""
    top = ranked[0].tokens_per_s
    near = [p for p in ranked if p.tokens_per_s >= (1.0 - band) * top][:most]
    # always ranked, unless the caller's candidates had none
    chain = next((p for p in ranked if p.is_chain), None)
    if chain is not None and not any(p.is_chain for p in near):
        near.append(chain)
    return near


def tie_margin(tree: Plan, chain: Plan, tie: float = TIE_MARGIN, z: float = TIE_Z) -> float:
    """How much faster than `chain` the measured `tree` must be to be chosen: `tie`, or `z` standard errors of the
    relative difference of their measured taus if more (taken as independent: a pessimistic bound for the tree)."""
    rel = [(p.tau_stderr or 0.0) / p.tau if p.tau > 0 else 0.0 for p in (tree, chain)]
    return max(tie, z * math.hypot(*rel))


def pick_measured(plans: Sequence[Plan], tie: float = TIE_MARGIN, z: float = TIE_Z) -> Plan:
    """The fastest measured chain, unless a tree measured faster than it by more than its tie_margin (`tie`, or
    `z` standard errors of the taus' difference): then the fastest such tree. A chain wins ties, and no tree that
    measured slower than the chain is ever returned. Faster: by speedup over AR decoded in the same rounds (the
    figure a plan predicts). Their tokens per second would carry AR's own speed in the rounds that each
    candidate's trim kept, which differ from candidate to candidate (kept_rounds)."""
    chains = [p for p in plans if p.is_chain]
    if not chains:
        return max(plans, key=lambda p: p.speedup)
    chain = max(chains, key=lambda p: p.speedup)
    clear = [
        p
        for p in plans
        if not p.is_chain and p.speedup > (1.0 + tie_margin(p, chain, tie, z)) * chain.speedup
    ]
    return max(clear, key=lambda p: p.speedup) if clear else chain


def decode_rounds(
    trees: Sequence[Sequence[int] | None], decode, rounds: int, first: int = 0
) -> list[list[Decoded]]:
    """Each of `trees` (None: AR, first) decoded once a round, rounds first .. first + rounds - 1,
    `decode(tree, round)`, the order reversed every other round (ABBA, so a shared machine's drift hits all alike)
    -> [round][tree] Decoded."""
    out = []
    for rnd in range(first, first + rounds):
        runs: list[Decoded] = [Decoded() for _ in trees]
        order = range(len(trees)) if rnd % 2 == 0 else reversed(range(len(trees)))
        for i in order:
            runs[i] = decode(trees[i], rnd)
        out.append(runs)
    return out


def kept_rounds(per_round: Sequence[Decoded], ar: Sequence[Decoded]) -> list[tuple[Decoded, Decoded]]:
    """The (candidate, AR) rounds trimmed_speedup sums: those with time on both sides, without the one with the
    highest and the one with the lowest candidate/AR ratio (3 rounds or more)."""
    pairs = [(r, a) for r, a in zip(per_round, ar, strict=True) if r.seconds > 0 and a.seconds > 0]
    if len(pairs) >= 3:
        pairs = sorted(pairs, key=lambda ra: ra[0].tokens_per_s / ra[1].tokens_per_s)[1:-1]
    return pairs


def trimmed_speedup(per_round: Sequence[Decoded], ar: Sequence[Decoded]) -> tuple[float, float]:
    """(speedup over AR, AR tokens per second) from rounds decoded back to back: the ratio of the summed tokens per
    second, as the bench measures a row, over the rounds left once the one with the highest and the one with the
    lowest candidate/AR ratio are dropped (3 rounds or more). A plain ratio of sums moves by tens of percent when
    one decode is caught by another process's burst (AR at half speed in one round: "2.05x" for a chain of tau 1.78
    on the tiny world); a median of the rounds' ratios does not, but it is not the bench's figure: the prompts'
    speedups spread wide (0.85x-1.65x on the tiny world at T = 0) and a ratio of sums weighs the slow ones by their
    time, so the median read 1-11% above it on the tiny world's T = 0 prompts."""
    pairs = kept_rounds(per_round, ar)
    if not pairs:
        return 0.0, 0.0
    run = sum((r for r, _ in pairs), Decoded())
    base = sum((a for _, a in pairs), Decoded())
    return (run.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else 0.0), base.tokens_per_s


# which plans as_measured gives the model's tau
TAU_FROM_MODEL = {"none": lambda plan: False, "chains": lambda plan: plan.is_chain, "all": lambda plan: True}


def as_measured(
    plan: Plan, per_round: Sequence[Decoded], ar: Sequence[Decoded], tau_from_model: str = "none"
) -> Plan:
    """`plan` with its tau, step and tau_stderr from the sums of its rounds `per_round`, and its speedup over AR
    (`ar`, decoded in the same rounds, back to back with it) trimmed_speedup's: a ratio of sums, as the bench's,
    with the rounds of the highest and the lowest ratio left out. tokens_per_s: that speedup times AR's tokens per
    second over the same rounds. The model's figures kept in tau_model / speedup_model.

    `tau_from_model` ("none", "chains" or "all"; TAU_FROM_MODEL): the plans whose tau is the model's, and whose
    speedup is the decoded one scaled by model tau / decoded tau over the rounds that speedup sums (the decodes
    emit a fixed number of tokens, so their time goes as 1 / tau, prefill apart); the decoded tau over every round
    is kept in tau_decoded.
    - "chains" (the planner at T > 0): a chain draws once a level, so its depths accept independently given the
      positions, and the product model, calibrated on every position of the calibration continuations, is its
      expectation: on the tiny world at T = 1 within 0.3-3% of chains [1]*2 .. [1]*6 decoded 96 times on 12 test
      prompts, where the 4 calibration prompts decoded read [1,1,1] 7% high (docs/decoder_speed.md). Trees keep
      their decoded tau (the model is optimistic for a multi-draw level).
    - "all" (the planner at T = 0): every tau is greedy_tau's, the decoder's own count over the greedy
      continuations of every calibration prompt, where a round decodes one prompt, and prompts differ widely in
      how far a greedy draft follows them (docs/decoder_speed.md)."""
    run = sum(per_round, Decoded())
    speedup, ar_tps = trimmed_speedup(per_round, ar)
    tau_model = plan.tau_model if plan.measured else _figure(plan.tau)
    tau, tau_decoded = run.tau, None
    if TAU_FROM_MODEL[tau_from_model](plan) and tau_model is not None and run.steps:
        tau, tau_decoded = tau_model, run.tau
        kept = sum((r for r, _ in kept_rounds(per_round, ar)), Decoded())
        speedup *= tau_model / (kept.tau if kept.steps else run.tau)
    return replace(
        plan,
        tau=tau,
        tau_decoded=tau_decoded,
        tau_stderr=run.tau_stderr,
        step_ms=1e3 * run.seconds / max(run.steps, 1),
        tokens_per_s=speedup * ar_tps,
        speedup=speedup,
        measured=True,
        tau_model=tau_model,
        speedup_model=plan.speedup_model if plan.measured else _figure(plan.speedup),
    )


def _figure(x: float) -> float | None:
    """A model figure, None where there is none (NaN: a plan that was never predicted, e.g. a draft head's)."""
    return None if math.isnan(x) else x


def settle_by_decoding(
    ranked: Sequence[Plan],
    decode,
    rounds: int,
    band: float = SETTLE_BAND,
    most: int = SETTLE_MOST,
    tie: float = TIE_MARGIN,
    z: float = TIE_Z,
    remeasure: bool = True,
    tau_from_model: str = "none",
) -> Plan:
    """The plan to use, by MEASURED speed (speedup over AR decoded in the same rounds): the candidates of
    settle_candidates and AR are each decoded once a round (decode_rounds), round r with the same prompt and the
    same seeded draws for every candidate. Each candidate's tau and step are its sums over the rounds, its speedup
    over AR a trimmed ratio of sums (as_measured), and pick_measured chooses (a chain wins ties: a tree must beat
    it by `tie`, or by `z` standard errors of their taus' difference). Why measure: the model's tau multiplies
    per-depth acceptances as if depths were independent (optimistic at T > 0 for any tree with a multi-draw level:
    [2,2,1] predicted 2.90, decoded 2.53 on the tiny world), and its step adds up parts that rank the top
    candidates, often within 1-2% of each other, wrongly.

    `remeasure`: the chosen plan and AR are then decoded again on REMEASURE_PASSES * `rounds` FRESH rounds (other
    seeds; rounds `rounds` onwards: with the Planner's prompts, other prompts), and those figures are the plan's
    prediction. The winner of near-ties is the one whose draws and timings were luckiest: its figures from the
    rounds that chose it are biased up (the winner's curse; the selection figures stay in `selected_speedup` /
    `selected_tau`). A tree chosen over the best chain must beat it again there: the chain is decoded on the fresh
    rounds too, and pick_measured decides between the two on those rounds alone (a chain wins ties), so a tree
    ahead only by the settling rounds' luck is dropped. A chain winner meets the settling's runner-up there
    (FINALISTS in all), which takes its place if it measures faster there (a tree over a chain: by pick_measured's
    margin). The plan returned is marked `measured`, keeps the model's figures (tau_model,
    speedup_model) and lists every candidate decoded. `tau_from_model` ("chains" at T > 0, "all" at T = 0): those
    plans' tau is the model's, their speedup scaled to it (as_measured), in the settling and on the fresh rounds
    alike."""
    near = settle_candidates(ranked, band, most)
    rounds_run = decode_rounds([None, *(p.tree for p in near)], decode, rounds)
    ar = [r[0] for r in rounds_run]
    settled = [
        as_measured(plan, [r[i] for r in rounds_run], ar, tau_from_model) for i, plan in enumerate(near, 1)
    ]
    table = [
        {
            "tree": p.tree,
            "tau_model": p.tau_model,
            "tau": p.tau,
            "tau_decoded": p.tau_decoded,
            "speedup_model": p.speedup_model,
            "speedup": p.speedup,
            "tokens": sum(r[i].tokens for r in rounds_run),
            "tau_stderr": p.tau_stderr,
        }
        for i, p in enumerate(settled, 1)
    ]
    finalists = [pick_measured(settled, tie, z)]
    chains = [p for p in settled if p.is_chain]
    if not finalists[0].is_chain and chains:  # a tree must beat the best chain again on the fresh rounds
        finalists.append(max(chains, key=lambda p: p.speedup))
    # and the next fastest of the settling, up to FINALISTS: four rounds leave a tree's tau ~10% noisy at T = 1
    for p in sorted(settled, key=lambda p: p.speedup, reverse=True):
        if len(finalists) < FINALISTS and all(p is not f for f in finalists):
            finalists.append(p)
    for p in finalists:
        p.selected_tau, p.selected_speedup = p.tau, p.speedup
    if not remeasure:
        return replace(finalists[0], candidates=table)
    fresh = decode_rounds(
        [None, *(p.tree for p in finalists)], decode, REMEASURE_PASSES * rounds, first=rounds
    )
    ar = [r[0] for r in fresh]
    again = [as_measured(p, [r[i] for r in fresh], ar, tau_from_model) for i, p in enumerate(finalists, 1)]
    return replace(pick_measured(again, tie, z), candidates=table)


class CalibrationDecodes:
    """settle_by_decoding's `decode` at batch 1: one generation of SETTLE_TOKENS tokens of calibration prompt
    r % len(prompts) with seed SETTLE_SEED + r, through the decoder the server and the bench run (one
    SpeculativeDecoder per tree, built once; AR its generate_autoregressive), timed whole as the bench times its
    rows (prefill included); each decoder's first call is preceded by an untimed short one (warm-up). EOS does not
    stop them (eos_token_id=[]): every candidate and AR emit exactly max_new_tokens, so a sampled draw that hits
    EOS early does not weigh its prefill against another's longer decode."""

    def __init__(self, target, draft, rule, prompts, sampling, max_new_tokens: int = SETTLE_TOKENS):
        self.target, self.draft, self.rule, self.prompts = target, draft, rule, prompts
        self.sampling, self.max_new_tokens = sampling, max_new_tokens
        self.device = next(target.parameters()).device
        self.decoders: dict = {}

    def __call__(self, tree: Sequence[int] | None, rnd: int) -> Decoded:

        key = None if tree is None else tuple(tree)
        ids = torch.tensor([list(self.prompts[rnd % len(self.prompts)])], device=self.device)
        if key not in self.decoders:
            dec = SpeculativeDecoder(self.target, self.draft, rule=self.rule, tree=list(key or (1,)))
            self.decoders[key] = dec.generate if key else dec.generate_autoregressive
            self._run(key, ids, SETTLE_SEED - 1, 8)  # warm-up
        return self._run(key, ids, SETTLE_SEED + rnd, self.max_new_tokens)

    def _run(self, key, ids: torch.Tensor, seed: int, max_new_tokens: int) -> Decoded:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        sync_device(self.device)
        t0 = time.perf_counter()
        out = self.decoders[key](
            ids, generator=gen, max_new_tokens=max_new_tokens, eos_token_id=[], **self.sampling
        )
        sync_device(self.device)
        seconds = time.perf_counter() - t0
        stats = out.stats
        return Decoded(
            stats.num_new_tokens, stats.num_drafts, stats.num_accepted_tokens, seconds, stats.accepted_sq
        )


class BatchedCalibrationDecodes:
    """settle_by_decoding's `decode` at `rows` rows: the batched speculative decoder (AR: its plain steps, as the
    server's batched AR) on `rows` calibration prompts (cycled; row i seeded SETTLE_SEED + round * rows + i, every
    candidate alike), one untimed step and BATCH_SETTLE_STEPS timed ones."""

    def __init__(self, target, draft, rule, prompts, sampling, rows: int, steps: int = BATCH_SETTLE_STEPS):
        self.target, self.draft, self.rule, self.prompts = target, draft, rule, prompts
        self.sampling, self.rows, self.steps = sampling, rows, steps

    @torch.inference_mode()
    def __call__(self, tree: Sequence[int] | None, rnd: int) -> Decoded:

        dec = BatchedSpeculativeDecoder(self.target, self.draft, self.rule, list(tree or (1,)))
        greedy = is_greedy(self.sampling.get("temperature", 1.0))
        for i in range(self.rows):
            seed = SETTLE_SEED + rnd * self.rows + i
            dec.add(
                list(self.prompts[(rnd * self.rows + i) % len(self.prompts)]),
                max_new_tokens=(self.steps + 2) * (len(tree or ()) + 1),
                eos_token_id=[],
                generator=None if greedy else torch.Generator().manual_seed(seed),
                **self.sampling,
            )
        drafting = tree is not None
        dec.step(drafting)  # warm-up (and the draft's prefill)

        def counts(rows) -> list[tuple[int, ...]]:
            return [
                (r.stats.num_new_tokens, r.stats.num_drafts, r.stats.num_accepted_tokens, r.stats.accepted_sq)
                for r in rows
            ]

        rows = list(dec.rows)
        before = counts(rows)
        t0 = time.perf_counter()
        for _ in range(self.steps):
            dec.step(drafting)
        seconds = time.perf_counter() - t0
        tokens, steps, accepted, accepted_sq = (
            sum(a[k] - b[k] for a, b in zip(counts(rows), before, strict=True)) for k in range(4)
        )
        return Decoded(tokens, steps, accepted, seconds, accepted_sq)
