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
rule's propose/verify).

The model only shortlists: its tau multiplies per-depth acceptances as if depths were independent, which is
optimistic at T > 0 for any tree with a multi-draw level (the tiny world: [2,2,1] predicted tau 2.90, decoded
2.53), and its step adds up parts that rank the top candidates, often within 1-2% of each other, wrongly. So the
plans predicted within SETTLE_BAND of the best (at most SETTLE_MOST), and always the best-ranked plain chain of
the same rule, are DECODED for real on the calibration prompts (settle_by_decoding): one generation per prompt
each, the same seeded draws for every candidate, AR in the same rounds, ABBA order. Their tau and tokens per
second are measured, not predicted, and a tree must beat the chain by TIE_MARGIN (or by TIE_Z standard errors
of the measured taus' difference, if more) to be chosen: a chain wins ties. Batched buckets where the model plans
speculation are settled the same way on a few real batched steps.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from resispec.decoding.fast_forward import fast_forward
from resispec.decoding.kv_cache import crop_cache, forward_logits, new_cache, tree_attention_mask
from resispec.decoding.tree import max_tree_nodes
from resispec.sampling import is_greedy, probs
from resispec.verify import VERIFIERS, covers
from resispec.verify.estimate import monte_carlo_alpha

# every count up to 10: the small trees the planner weighs against each other are 5-9 tokens ([1,1,1,1] 5, [2,1,1]
# and [3,1] 7, [2,1,1,1] 9), and a CPU's cost is not linear there: on the tiny world 6 tokens cost 5.9 ms and 7
# cost 6.3-6.6 (the GEMM's row blocking), so 7 interpolated between 6 and 8 was 0.2-0.4 ms short, enough to rank
# [2,1,1] above the chains it measured 4-11% behind
NODE_GRID = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 24, 28, 32)
BATCH_NODE_GRID = (1, 2, 3, 4, 6, 8, 12, 16)  # tokens per row timed at batch sizes > 1
# the tree whose steps measure the host overhead, with the one-node chain for the part per node; at 4 rows
# of the tiny world its 10 nodes a row cost ~24 ms a step beyond the forwards and a one-node chain's ~5 ms: charged
# to every candidate, that one figure planned "no speculation" at every batch size > 1
OVERHEAD_TREE = (2, 2, 1)
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
SETTLE_SEED = (
    20_000  # the seeds of the settling decodes: round r draws from SETTLE_SEED + r, every candidate alike
)


@dataclass
class CostModel:
    """Forward times in ms by number of tokens fed (after a cached prefix), and the per-step host overhead."""

    target_ms: dict[int, float]
    draft_ms: dict[int, float]
    overhead_ms: float = 0.0
    # ... and per tree node of a row (batched steps: holey caches widen attention, each node is bookkept)
    overhead_per_node_ms: float = 0.0
    # ms to propose and verify one node by number of draws (sampled decoding; empty at temperature 0, where the
    # walk is one argmax): a walk verifies depth d only when it reaches d, see verify_cost
    verify_ms: dict[int, float] = field(default_factory=dict)
    # ms per further node of a one-draw run that the walk verifies in one rule call (walk.chain_from): proposing it
    # and its row of the batched verification; 0 = each such node costs verify_ms[1] (no batching)
    verify_row_ms: float = 0.0
    # ms more than verify_ms[n] for the step's FIRST rule call (the root's, n = its draws), beyond what a one-draw
    # first call pays (that part is in overhead_ms): it follows the target's forward, which has evicted the CPU
    # caches. Resispec on the tiny world: 1.36-1.40 ms a 3-4 draw root node in the decoder, 0.95-1.06 timed back to
    # back, 0.89-0.90 for a 2-draw node later in the same walk
    root_verify_extra_ms: dict[int, float] = field(default_factory=dict)
    # a chain's accept walk is part of overhead_ms (measured, not predicted): the batched decoder verifies the
    # chains of all rows at once (walk.walk_one_draw_chains, rules with one_draw_is_standard), a few batched ops
    # whatever the rows, where verify_ms times a row's call
    chain_walk_in_overhead: bool = False

    @staticmethod
    def _at(table: dict[int, float], n: int) -> float:
        keys = sorted(table)
        if n <= keys[0]:
            return table[keys[0]]
        for lo, hi in itertools.pairwise(keys):
            if n <= hi:
                return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)
        return table[keys[-1]] * n / keys[-1]  # beyond the grid: linear in tokens (pessimistic)

    def target(self, n: int) -> float:
        return self._at(self.target_ms, n)

    def draft(self, n: int) -> float:
        return self._at(self.draft_ms, n)

    def step_ms(self, tree: Sequence[int]) -> float:
        """Predicted ms of one speculative step with tree `tree` (no repeated draws merged: an upper bound)."""
        widths, width = [1], 1
        for b in tree[:-1]:
            width *= b
            widths.append(width)
        return (
            sum(self.draft(w) for w in widths)
            + self.target(1 + max_tree_nodes(list(tree)))
            + self.overhead_ms
            + self.overhead_per_node_ms * max_tree_nodes(list(tree))
        )

    def verify_cost(self, tree: Sequence[int], alpha: dict[int, float]) -> float:
        """Expected ms of the accept walk: depth d's node is verified with probability prod_{j < d} alpha(b_j),
        except that, once verify_row_ms is measured, a run of one-draw depths (a chain, or a tree's tail; a leaf
        is not verified) costs one call when the walk reaches its first node (walk.chain_from): verify_ms[1], plus
        verify_row_ms per further node; the root's call costs root_verify_extra_ms more. 0 for a chain when
        chain_walk_in_overhead."""
        if self.chain_walk_in_overhead and set(tree) <= {1}:
            return 0.0
        total, reach, depth = (self.root_verify_extra_ms.get(tree[0], 0.0) if tree else 0.0), 1.0, 0
        while depth < len(tree):
            b, run = tree[depth], 1
            while self.verify_row_ms > 0 and b == 1 and depth + run < len(tree) and tree[depth + run] == 1:
                run += 1
            total += reach * (self.verify_ms.get(b, 0.0) + (run - 1) * self.verify_row_ms)
            for b_j in tree[depth : depth + run]:
                reach *= alpha[b_j]
            depth += run
        return total


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
        return (
            f"tree={self.tree} measured on calibration: tau {self.tau:.2f} (model {self.tau_model:.2f}), "
            f"step {self.step_ms:.1f} ms, speedup {self.speedup:.2f}x over AR (model {self.speedup_model:.2f}x); "
            f"decoded {decoded}; start-up {self.startup_s:.1f} s"
        )

    def as_dict(self) -> dict:
        return asdict(self)


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


class ForwardProbe:
    """One cached forward of `model` over n new tokens per row (n <= longest) after a fixed random prefix of
    `prefix_len` tokens, under a tree-style 4D mask, with `batch` rows; the cache is cropped back to the prefix
    after each, so every call times the same work. What forward_table times, and the drift reference of the
    overhead measurements (measure_overhead, measure_batch_overhead)."""

    @torch.inference_mode()
    def __init__(
        self,
        model: torch.nn.Module,
        batch: int = 1,
        longest: int = 1,
        prefix_len: int = 64,
        vocab: int | None = None,
    ) -> None:
        self.dev = next(model.parameters()).device
        vocab = vocab or model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, vocab, (batch, prefix_len), generator=gen).to(self.dev)
        self.ids = torch.randint(0, vocab, (batch, longest), generator=gen).to(self.dev)
        self.pos = torch.arange(prefix_len, prefix_len + longest, device=self.dev)[None].expand(batch, -1)
        self.batch, self.prefix_len, self.dtype = batch, prefix_len, model.dtype
        self.masks: dict[int, torch.Tensor | None] = {}
        self.cache = new_cache(model)
        self.model = fast_forward(model)  # the decoder's forward (its default), not the HF module's
        forward_logits(self.model, prefix, self.cache, logits_to_keep=1)

    def _mask(self, n: int) -> torch.Tensor | None:
        if n not in self.masks:
            causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=self.dev))
            self.masks[n] = (
                tree_attention_mask(self.prefix_len, causal, self.dtype).expand(self.batch, -1, -1, -1)
                if n > 1 or self.batch > 1
                else None
            )
        return self.masks[n]

    @torch.inference_mode()
    def seconds(self, n: int = 1) -> float:
        """Run the forward over n tokens per row -> its wall-clock seconds (device-synchronised)."""
        mask = self._mask(n)
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        t0 = time.perf_counter()
        forward_logits(self.model, self.ids[:, :n], self.cache, self.pos[:, :n], mask)
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        dt = time.perf_counter() - t0
        crop_cache(self.cache, self.prefix_len)  # back to the prefix: every forward extends the same prefix
        return dt


@torch.inference_mode()
def forward_table(
    model: torch.nn.Module,
    nodes: Sequence[int] = NODE_GRID,
    prefix_len: int = 64,
    reps: int = 7,
    vocab: int | None = None,
    batch: int = 1,
    between: torch.nn.Module | None = None,
) -> dict[int, float]:
    """Median ms of one cached forward over n new tokens per row under a tree-style 4D mask, for every n of
    `nodes`, with `batch` rows (the batched decoder's step: every row feeds its tree, padded to the widest).
    The counts are timed round-robin (one forward of each count per round, after a warm-up round), so a shared
    machine's speed drift hits every count alike and the RATIOS between counts, which decide the tree, hold.
    between: a model run (untimed, one token per row) before each timed forward, as the decoder's step runs the
    other model in between. It matters for a small draft: timed back to back its weights stay in the CPU caches
    (0.24 ms per forward for the tiny world's draft), in a decode step the target's forward has evicted them
    (1.0 ms). Without it the difference lands in the measured host overhead instead of the draft's cost."""
    probe = ForwardProbe(model, batch, max(nodes), prefix_len, vocab)
    other = None if between is None else ForwardProbe(between, batch, 1, prefix_len, vocab)
    times: dict[int, list[float]] = {n: [] for n in nodes}
    for rnd in range(reps + 1):  # round 0 is a warm-up
        for n in nodes:
            if other is not None:
                other.seconds(1)
            dt = probe.seconds(n)
            if rnd:
                times[n].append(dt)
    return {n: 1e3 * statistics.median(times[n]) for n in nodes}


def measure_costs(
    target: torch.nn.Module,
    draft: torch.nn.Module | None = None,
    nodes: Sequence[int] = NODE_GRID,
    reps: int = 7,
    batch: int = 1,
) -> CostModel:
    """Target (and draft) forward time against tokens fed per row, `batch` rows, on this device (the planner's
    cost model). The draft is timed with a target forward before each of its forwards (forward_table's
    `between`), as in a decode step. Each table is made non-decreasing in tokens (a suffix minimum): feeding more
    tokens never costs less, so a slow outlier at a small count (a noisy shared machine) does not make AR look
    slower than a tree step."""
    return CostModel(
        target_ms=monotone(forward_table(target, nodes, reps=reps, batch=batch)),
        draft_ms={}
        if draft is None
        else monotone(forward_table(draft, nodes, reps=reps, batch=batch, between=target)),
    )


def monotone(table: dict[int, float]) -> dict[int, float]:
    """{n: min over m >= n of table[m]}: the largest non-decreasing table below the measured one."""
    out, low = {}, math.inf
    for n in sorted(table, reverse=True):
        low = min(low, table[n])
        out[n] = low
    return dict(sorted(out.items()))


def measure_overhead(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    rule,
    prompt: Sequence[int],
    sampling: dict,
    cost: CostModel,
    tree: Sequence[int] = OVERHEAD_TREE,
    max_new_tokens: int = 32,
    alpha: dict[int, float] | None = None,
) -> float:
    """Host ms per speculative step beyond the forwards (and, given alpha, the verification) that the cost model
    predicts, from measure_step_ms."""
    step_ms = measure_step_ms(target, draft, rule, prompt, sampling, cost, tree, max_new_tokens)
    return _beyond_prediction(step_ms, cost, tree, alpha)


def measure_step_ms(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    rule,
    prompt: Sequence[int],
    sampling: dict,
    cost: CostModel,
    tree: Sequence[int],
    max_new_tokens: int = 32,
    warmup: bool = True,
) -> float:
    """Ms per speculative step of tree `tree` on this device: one short decode of `prompt` (after a shorter
    untimed one, `warmup`), timed from its second step (the first carries the prompt's prefill on both models,
    which is not a step's cost: counted in, it made every plan ~10% pessimistic on the tiny world), at the speed
    the cost model's tables were measured at (`_drift`)."""
    from resispec.decoding.engine import SpeculativeDecoder
    from resispec.verify import build_rule

    dec = SpeculativeDecoder(
        target, draft, rule=build_rule(rule) if isinstance(rule, str) else rule, tree=tree
    )
    ids = torch.tensor([list(prompt)], device=next(target.parameters()).device)
    kwargs = {**sampling, "max_new_tokens": max_new_tokens, "generator": torch.Generator().manual_seed(0)}
    if warmup:
        dec.generate(ids, **{**kwargs, "max_new_tokens": 8})
    stream = dec.generate_stream(ids, **kwargs)
    stats = dec.last_stats
    next(stream)  # the prefill and the first step
    probe, seconds, references = ForwardProbe(target), 0.0, []
    first = stats.num_drafts
    while True:
        t0 = time.perf_counter()
        if next(stream, None) is None:
            break
        seconds += time.perf_counter() - t0
        references.append(probe.seconds(1))
    return 1e3 * seconds / max(stats.num_drafts - first, 1) * _drift(cost, references)


def _drift(cost: CostModel, references: Sequence[float]) -> float:
    """The factor that brings times measured now to the speed of `cost`'s tables: their one-token target forward
    over the same forward timed now (`references`, seconds, between the measured steps). On a shared CPU the
    speed drifts by +-30% within a minute; unscaled, a step timed in a slow minute against tables from a fast one
    came out as up to 35 ms of "host overhead" at 16 rows (and 0 in the next run), so the plan flipped between
    trees and no speculation from one start-up to the next. 1 when the tables hold no time (tests)."""
    table = cost.target(1)
    now = 1e3 * statistics.median(references) if references else 0.0
    return table / now if table > 0 and now > 0 else 1.0


def _beyond_prediction(
    step_ms: float, cost: CostModel, tree: Sequence[int], alpha: dict[int, float] | None
) -> float:
    """A measured step's ms beyond what `cost` predicts for its forwards (and, given alpha, its verification)."""
    predicted = CostModel(cost.target_ms, cost.draft_ms).step_ms(list(tree))
    if alpha is not None:
        predicted += cost.verify_cost(list(tree), alpha)
    return max(step_ms - predicted, 0.0)


@torch.inference_mode()
def measure_batch_overhead(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    rule,
    prompt: Sequence[int],
    sampling: dict,
    cost: CostModel,
    rows: int,
    tree: Sequence[int] = OVERHEAD_TREE,
    steps: int = 12,
    alpha: dict[int, float] | None = None,
) -> float:
    """Host ms per step of the batched speculative decoder with `rows` rows beyond what `cost` (forwards timed at
    that batch size; verification already scaled to the rows) predicts: a few steps on `prompt` in every row.
    It replaces the guess "batch-1 overhead times the rows": per-row bookkeeping, masks and cache repacks do not
    scale that way, and whatever the forward tables miss at that batch size lands here too."""
    from resispec.decoding.batch import BatchedSpeculativeDecoder

    dec = BatchedSpeculativeDecoder(target, draft, rule, list(tree))
    settings = {k: sampling[k] for k in ("temperature", "top_k", "top_p") if k in sampling}
    for i in range(rows):
        gen = None if is_greedy(settings.get("temperature", 1.0)) else torch.Generator().manual_seed(i)
        dec.add(
            list(prompt),
            max_new_tokens=(steps + 3) * (len(tree) + 1),
            eos_token_id=[],
            generator=gen,
            **settings,
        )
    dec.step()  # warm-up
    probe, seconds, references = ForwardProbe(target, rows), 0.0, []
    for _ in range(steps):
        t0 = time.perf_counter()
        dec.step()
        seconds += time.perf_counter() - t0
        references.append(probe.seconds(1))
    step_ms = 1e3 * seconds / steps
    return _beyond_prediction(step_ms * _drift(cost, references), cost, tree, alpha)


@torch.inference_mode()
def node_logits(
    target: torch.nn.Module, draft: torch.nn.Module, sequences: Sequence[Sequence[int]], start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits [N, V] (the pair's shared vocabulary, float32) at the positions >= `start` of each
    sequence: the nodes a calibration scores."""
    dev = next(target.parameters()).device
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    ps, qs = [], []
    for seq in sequences:
        ids = torch.tensor([list(seq)], device=dev)
        ps.append(target(input_ids=ids).logits[0, start - 1 : -1, :vocab].float())
        qs.append(draft(input_ids=ids).logits[0, start - 1 : -1, :vocab].float())
    return torch.cat(ps), torch.cat(qs)


@torch.inference_mode()
def calibrate_alpha(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    rule,
    settings: dict,
    start: int,
    max_draws: int = 4,
    samples: int = 64,
    seed: int = 0,
    logits: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[int, float]:
    """Mean per-node acceptance alpha(n), n = 1..max_draws, of `rule` (a VERIFIERS key, or the rule object the
    decoder will run: resispec_auto with a policy) under `settings` (temperature/top-k/top-p)
    at the positions >= `start` of each sequence (prompt + the target's own continuation). Temperature 0: the
    greedy rule's acceptance, P(argmax p among the top-n of q). `logits`: those nodes' (target, draft) logits when
    the caller already has them (node_logits of the same sequences and start)."""
    t_logits, d_logits = logits if logits is not None else node_logits(target, draft, sequences, start)
    out = {}
    if is_greedy(settings.get("temperature", 1.0)):
        hits = greedy_hits(t_logits, d_logits, max_draws).double().mean(-1)
        return {n: float(hits[min(n, len(hits)) - 1]) for n in range(1, max_draws + 1)}
    p, q = probs(t_logits, **settings), probs(d_logits, **settings)
    rule_obj = VERIFIERS[rule] if isinstance(rule, str) else rule
    gen = torch.Generator(device=p.device).manual_seed(seed)
    for n in range(1, max_draws + 1):
        if covers(rule_obj.closed_form_draws, n):
            out[n] = float(rule_obj.acceptance(p.double(), q.double(), n).mean())
        else:
            out[n] = float(monte_carlo_alpha(rule_obj, p, q, n, samples, gen)[0].mean())
    return out


def expected_tau(tree: Sequence[int], alpha: dict[int, float]) -> float:
    """1 + sum_d prod_{j <= d} alpha(b_j): the accepted length if depths accept independently."""
    tau, reach = 1.0, 1.0
    for b in tree:
        reach *= alpha[b]
        tau += reach
    return tau


def greedy_hits(t_logits: torch.Tensor, d_logits: torch.Tensor, max_draws: int) -> torch.Tensor:
    """[max_draws, N] bool: at each node, the target's argmax among the draft's top n, row n - 1 (n = 1..max_draws).
    Its row means are greedy alpha(n)."""
    best = t_logits.argmax(-1, keepdim=True)  # [N, 1]
    top = d_logits.topk(min(max_draws, d_logits.shape[-1]), dim=-1).indices  # [N, n]
    return (top == best).cumsum(-1).bool().T


def candidate_trees(max_nodes: int = 32, max_depth: int = 6, max_branch: int = 4) -> list[list[int]]:
    """Per-depth branchings, non-increasing with depth, at most `max_nodes` nodes (chains included)."""
    out = []
    for depth in range(1, max_depth + 1):
        for tree in itertools.product(range(1, max_branch + 1), repeat=depth):
            if all(a >= b for a, b in itertools.pairwise(tree)) and max_tree_nodes(list(tree)) <= max_nodes:
                out.append(list(tree))
    return out


def rank_trees(
    cost: CostModel, alpha: dict[int, float], candidates: Sequence[Sequence[int]] | None = None
) -> list[Plan]:
    """Every candidate tree's plan, the highest predicted tokens per second first (module docstring); ties keep
    the candidates' order (shallower and narrower first)."""
    ar_tps = 1e3 / cost.target(1)
    plans = []
    usable = [t for t in (candidates or candidate_trees(max_branch=max(alpha))) if all(b in alpha for b in t)]
    for tree in usable:
        tau = expected_tau(tree, alpha)
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
    measured slower than the chain is ever returned."""
    chains = [p for p in plans if p.is_chain]
    if not chains:
        return max(plans, key=lambda p: p.tokens_per_s)
    chain = max(chains, key=lambda p: p.tokens_per_s)
    clear = [
        p
        for p in plans
        if not p.is_chain and p.tokens_per_s > (1.0 + tie_margin(p, chain, tie, z)) * chain.tokens_per_s
    ]
    return max(clear, key=lambda p: p.tokens_per_s) if clear else chain


def settle_by_decoding(
    ranked: Sequence[Plan],
    decode,
    rounds: int,
    band: float = SETTLE_BAND,
    most: int = SETTLE_MOST,
    tie: float = TIE_MARGIN,
    z: float = TIE_Z,
) -> Plan:
    """The plan to use, by MEASURED tokens per second: the candidates of settle_candidates and AR are each decoded
    once a round, `decode(tree, round)` -> Decoded (tree None: AR), round r with the same prompt and the same
    seeded draws for every candidate, the order reversed every other round (ABBA, so a shared machine's drift hits
    all alike). Each candidate's tau, step and tokens per second are its sums over the rounds, its speedup is over
    AR's tokens per second in the same rounds, and pick_measured chooses (a chain wins ties: a tree must beat it by
    `tie`, or by `z` standard errors of their taus' difference). Why measure: the model's tau multiplies per-depth
    acceptances as if depths were independent (optimistic at T > 0 for any tree with a multi-draw level: [2,2,1]
    predicted 2.90, decoded 2.53 on the tiny world), and its step adds up parts that rank the top candidates, often
    within 1-2% of each other, wrongly. The plan returned is marked `measured`, keeps the model's figures
    (tau_model, speedup_model) and lists every candidate decoded."""
    near = settle_candidates(ranked, band, most)
    trees: list[list[int] | None] = [None, *(p.tree for p in near)]
    runs = [Decoded() for _ in trees]
    for rnd in range(rounds):
        order = range(len(trees)) if rnd % 2 == 0 else reversed(range(len(trees)))
        for i in order:
            runs[i] = runs[i] + decode(trees[i], rnd)
    ar_tps = runs[0].tokens_per_s
    settled = [
        replace(
            plan,
            tau=run.tau,
            tau_stderr=run.tau_stderr,
            step_ms=1e3 * run.seconds / max(run.steps, 1),
            tokens_per_s=run.tokens_per_s,
            speedup=run.tokens_per_s / ar_tps if ar_tps > 0 else 0.0,
            measured=True,
            tau_model=plan.tau,
            speedup_model=plan.speedup,
        )
        for plan, run in zip(near, runs[1:], strict=True)
    ]
    table = [
        {
            "tree": p.tree,
            "tau_model": p.tau_model,
            "tau": p.tau,
            "speedup_model": p.speedup_model,
            "speedup": p.speedup,
            "tokens": run.tokens,
            "tau_stderr": p.tau_stderr,
        }
        for p, run in zip(settled, runs[1:], strict=True)
    ]
    return replace(pick_measured(settled, tie, z), candidates=table)


class _CalibrationDecodes:
    """settle_by_decoding's `decode` at batch 1: one generation of SETTLE_TOKENS tokens of calibration prompt
    r % len(prompts) with seed SETTLE_SEED + r, through the decoder the server and the bench run (one
    SpeculativeDecoder per tree, built once; AR its generate_autoregressive), timed whole as the bench times its
    rows (prefill included); each decoder's first call is preceded by an untimed short one (warm-up)."""

    def __init__(self, target, draft, rule, prompts, sampling, max_new_tokens: int = SETTLE_TOKENS):
        self.target, self.draft, self.rule, self.prompts = target, draft, rule, prompts
        self.sampling, self.max_new_tokens = sampling, max_new_tokens
        self.device = next(target.parameters()).device
        self.decoders: dict = {}

    def __call__(self, tree: Sequence[int] | None, rnd: int) -> Decoded:
        from resispec.decoding.engine import SpeculativeDecoder

        key = None if tree is None else tuple(tree)
        ids = torch.tensor([list(self.prompts[rnd % len(self.prompts)])], device=self.device)
        if key not in self.decoders:
            dec = SpeculativeDecoder(self.target, self.draft, rule=self.rule, tree=list(key or (1,)))
            self.decoders[key] = dec.generate if key else dec.generate_autoregressive
            self._run(key, ids, SETTLE_SEED - 1, 8)  # warm-up
        return self._run(key, ids, SETTLE_SEED + rnd, self.max_new_tokens)

    def _run(self, key, ids: torch.Tensor, seed: int, max_new_tokens: int) -> Decoded:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.decoders[key](ids, generator=gen, max_new_tokens=max_new_tokens, **self.sampling)
        _sync(self.device)
        seconds = time.perf_counter() - t0
        stats = out.stats
        return Decoded(
            stats.num_new_tokens, stats.num_drafts, stats.num_accepted_tokens, seconds, stats.accepted_sq
        )


class _BatchedCalibrationDecodes:
    """settle_by_decoding's `decode` at `rows` rows: the batched speculative decoder (AR: its plain steps, as the
    server's batched AR) on `rows` calibration prompts (cycled; row i seeded SETTLE_SEED + round * rows + i, every
    candidate alike), one untimed step and BATCH_SETTLE_STEPS timed ones."""

    def __init__(self, target, draft, rule, prompts, sampling, rows: int, steps: int = BATCH_SETTLE_STEPS):
        self.target, self.draft, self.rule, self.prompts = target, draft, rule, prompts
        self.sampling, self.rows, self.steps = sampling, rows, steps

    @torch.inference_mode()
    def __call__(self, tree: Sequence[int] | None, rnd: int) -> Decoded:
        from resispec.decoding.batch import BatchedSpeculativeDecoder

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


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _verify_probe(
    vocab: int, rows: int, device, nodes: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """Softmax rows p, q [rows, V] and a seeded generator on their device: what the verification timings run on.
    `nodes`: real (p, q) rows, e.g. the calibration's (node_logits), cycled to `rows` rows; without them, a random
    target and a correlated draft (on the tiny world the two cost about the same: resispec at 3 draws 1.06 against
    0.98 ms)."""
    if nodes is not None:
        p, q = nodes
        idx = torch.arange(rows, device=p.device) % p.shape[0]
        return p[idx].to(device), q[idx].to(device), torch.Generator(device=device).manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(rows, vocab, generator=gen)
    p = torch.softmax(logits, -1).to(device)
    q = torch.softmax(logits + torch.randn(rows, vocab, generator=gen), -1).to(device)
    return p, q, torch.Generator(device=p.device).manual_seed(0)


@torch.no_grad()
def measure_verify_ms(
    rule, vocab: int, max_draws: int = 4, reps: int = 15, device="cpu", nodes=None, between=None
) -> dict[int, float]:
    """Median ms to propose n draws and verify one node of `rule` (a rule object), n = 1..max_draws, on softmax rows
    of this vocabulary size, one row per call (`nodes`: real (p, q) rows to cycle through, see _verify_probe): the
    accept walk's cost per node. between: a model whose one-token forward runs (untimed) before each timed call, as
    the decoder's step runs the target before its walk's first call: on the tiny world resispec's 3-4 draw
    verification took 0.95-1.06 ms back to back, 1.45-1.53 ms so timed (1.36-1.40 ms as a root node in the
    decoder), see CostModel.root_verify_extra_ms."""
    p, q, rng = _verify_probe(vocab, reps + 2, device, nodes)
    other = None if between is None else ForwardProbe(between)
    out = {}
    for n in range(1, max_draws + 1):
        times = []
        for i in range(reps + 2):
            if other is not None:
                other.seconds(1)
            t0 = time.perf_counter()
            token, _slot = rule.verify(p[i : i + 1], rule.propose(q[i : i + 1], n, rng), rng)
            token.tolist()  # the walk's host sync
            times.append(time.perf_counter() - t0)
        out[n] = 1e3 * statistics.median(times[2:])
    return out


@torch.no_grad()
def measure_verify_row_ms(rule, vocab: int, rows: int = 4, reps: int = 15, device="cpu", nodes=None) -> float:
    """Median ms per further node of a one-draw run verified in one call (walk.chain_from): `rows` one-draw
    proposals and one batched verification, less one node's propose-and-verify, over rows - 1. Timed back to back:
    the run is never a step's first call once its root has been verified (CostModel.root_verify_extra_ms)."""
    p, q, rng = _verify_probe(vocab, rows, device, nodes)

    def run(k: int) -> float:
        t0 = time.perf_counter()
        parts = [rule.propose(q[i : i + 1], 1, rng) for i in range(k)]
        proposal = parts[0] if k == 1 else type(parts[0]).cat(parts)
        token, _slot = rule.verify(p[:k], proposal, rng)
        token.tolist()
        return time.perf_counter() - t0

    one, many = [], []
    for _ in range(reps + 2):
        one.append(run(1))
        many.append(run(rows))
    return 1e3 * max(statistics.median(many[2:]) - statistics.median(one[2:]), 0.0) / (rows - 1)


class Planner:
    """Plans trees for one target on this device: the cost model measured once, the target's own continuations
    of `prompts` generated once per sampling setting, one calibration per (draft, rule, sampling) asked for.
    Used by the bench (tree=auto rows) and by the server (decode.tree=auto)."""

    def __init__(
        self, target: torch.nn.Module, prompts: Sequence[Sequence[int]], continuation_tokens: int = 32
    ):
        if not prompts:
            raise ValueError("the planner needs at least one calibration prompt")
        self.target, self.prompts = target, [list(p) for p in prompts]
        self.continuation_tokens = continuation_tokens
        self._ms: dict[tuple[int, int], dict[int, float]] = {}  # (id(model), batch) -> ms by tokens per row
        t0 = time.perf_counter()
        self._table(target, 1)  # the target's batch-1 costs now, before any calibration
        self.init_s = time.perf_counter() - t0  # start-up spent here, before any plan
        self._continuations: dict[tuple, list[list[int]]] = {}

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
        key = tuple(sorted(settings.items()))
        if key not in self._continuations:
            from resispec.decoding.engine import SpeculativeDecoder

            dec = SpeculativeDecoder(self.target, self.target, rule="chain", tree=[1])
            device = next(self.target.parameters()).device
            seqs = []
            for i, p in enumerate(self.prompts):
                ids = torch.tensor([p], device=device)
                gen = torch.Generator(device=device).manual_seed(10_000 + i)
                out = dec.generate_autoregressive(
                    ids, generator=gen, max_new_tokens=self.continuation_tokens, **settings
                )
                seqs.append(out.sequences[0].tolist())
            self._continuations[key] = seqs
        return self._continuations[key]

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
        calibration included). `threads_at` (batch size -> torch threads; None: torch's setting): each size is
        timed on the threads it will decode on."""
        initial_threads = torch.get_num_threads()
        try:
            return self._choose_by_batch(draft, rule, sampling, batch_sizes, auto_policy, threads_at)
        finally:
            torch.set_num_threads(initial_threads)

    def _choose_by_batch(
        self, draft, rule, sampling, batch_sizes, auto_policy, threads_at
    ) -> dict[int, Plan]:
        from resispec.verify import build_rule

        def on_threads_of(batch: int) -> None:
            if threads_at is not None:
                torch.set_num_threads(threads_at(batch))

        t_start = time.perf_counter()
        settings = {k: sampling[k] for k in ("temperature", "top_k", "top_p") if k in sampling}
        on_threads_of(1)  # the verification timings below and the batch-1 forward table
        cost = self.cost_for(draft)
        # each prompt's nodes once: the calibration scores them, and the first prompt's time the verification
        node_sets = [
            (seq, len(p), node_logits(self.target, draft, [seq], len(p)))
            for seq, p in zip(self._sequences(settings), self.prompts, strict=True)
        ]
        rule_obj = build_rule(rule, auto_policy)  # the rule the decoder runs (resispec_auto: with its policy)
        alphas = [
            calibrate_alpha(self.target, draft, [seq], rule_obj, settings, start=start, logits=logits)
            for seq, start, logits in node_sets
        ]
        alpha = {n: sum(a[n] for a in alphas) / len(alphas) for n in alphas[0]}
        if not is_greedy(settings.get("temperature", 1.0)):
            vocab = min(self.target.config.vocab_size, draft.config.vocab_size)
            device = next(draft.parameters()).device
            # timed on the calibration's own nodes (the first prompt's): the cost depends on the distributions
            t_logits, d_logits = node_sets[0][2]
            nodes = probs(t_logits, **settings), probs(d_logits, **settings)
            cost.verify_ms = measure_verify_ms(rule_obj, vocab, max(alpha), device=device, nodes=nodes)
            cost.verify_row_ms = measure_verify_row_ms(rule_obj, vocab, device=device, nodes=nodes)
            # the first call of a step follows the target's forward: timed that way, its extra over a one-draw one
            cold = measure_verify_ms(
                rule_obj, vocab, max(alpha), device=device, nodes=nodes, between=self.target
            )
            base = cold[1] - cost.verify_ms[1]
            cost.root_verify_extra_ms = {n: max(cold[n] - cost.verify_ms[n] - base, 0.0) for n in cold}
        plans = {}
        shared_s = time.perf_counter() - t_start  # the calibration and verification timings serve every size
        for b in batch_sizes:
            t_b = time.perf_counter()
            on_threads_of(b)
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
            ranked = rank_trees(at_b, alpha)
            if b == 1:  # always settled on real decodes: the candidates and the best chain, AR alongside
                decode = _CalibrationDecodes(self.target, draft, rule_obj, self.prompts, settings)
                rounds = max(2, min(SETTLE_PROMPTS, len(self.prompts)))
                plans[b] = settle_by_decoding(ranked, decode, rounds)
            elif ranked[0].speedup > 1.0:  # speculation planned at this size: settled on real batched steps
                decode = _BatchedCalibrationDecodes(
                    self.target, draft, rule_obj, self.prompts, settings, rows=b
                )
                plans[b] = settle_by_decoding(ranked, decode, BATCH_SETTLE_ROUNDS, most=BATCH_SETTLE_MOST)
            else:  # the model says do not speculate here: left to it (and to the scheduler's online model)
                plans[b] = ranked[0]
            plans[b].startup_s = shared_s + time.perf_counter() - t_b
        return plans
