"""The planner's cost model: forward times by tokens fed (ForwardProbe, forward_table), the measured host
overhead of real steps (measure_overhead, measure_batch_overhead, against the speed drift of a shared machine) and
the accept walk's verification cost (measure_verify_ms, measure_verify_row_ms). See the package docstring."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from resispec.decoding.batch import BatchedSpeculativeDecoder
from resispec.decoding.engine import SpeculativeDecoder
from resispec.decoding.fast_forward import fast_forward
from resispec.decoding.kv_cache import crop_cache, forward_logits, new_cache, tree_attention_mask
from resispec.decoding.tree import max_tree_nodes
from resispec.sampling import is_greedy
from resispec.verify import build_rule

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
    return beyond_prediction(step_ms, cost, tree, alpha)


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
    return 1e3 * seconds / max(stats.num_drafts - first, 1) * drift(cost, references)


def drift(cost: CostModel, references: Sequence[float]) -> float:
    """The factor that brings times measured now to the speed of `cost`'s tables: their one-token target forward
    over the same forward timed now (`references`, seconds, between the measured steps). On a shared CPU the
    speed drifts by +-30% within a minute; unscaled, a step timed in a slow minute against tables from a fast one
    came out as up to 35 ms of "host overhead" at 16 rows (and 0 in the next run), so the plan flipped between
    trees and no speculation from one start-up to the next. 1 when the tables hold no time (tests)."""
    table = cost.target(1)
    now = 1e3 * statistics.median(references) if references else 0.0
    return table / now if table > 0 and now > 0 else 1.0


def beyond_prediction(
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
    return beyond_prediction(step_ms * drift(cost, references), cost, tree, alpha)


def sync_device(device) -> None:
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
