"""Exact laws of a verification rule by enumeration, shared by the enumeration tests (tests/unit/
test_verify_enumeration.py: each rule's output law on the reference cases; tests/unit/test_decoding_enumeration.py:
the decoder's joint law of its first tokens). What is enumerated and why it is exact: test_verify_enumeration.py's
module docstring."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import fields

import torch

from resispec.verify.auto import AutoProposal
from resispec.verify.base import Proposal, top_set
from resispec.verify.distinct import hub_split

# rows per verify call, ALWAYS (short calls are padded): a row's output may depend on the batch size (resispec's T is
# located by a grid whose size follows the batch; where g(T) is flat at 0, float noise picks different points of the
# flat part, all exact but each with its own plan), so every call of one enumeration must see the same batch size
CHUNK = 1 << 12
REJECT = 1.0  # an acceptance uniform that rejects (u < t is false for every t <= 1)


class ScriptedUniforms:
    """Stands in for torch.rand: call i returns blocks[i] reshaped to the requested shape. A float block fills the
    whole request (used where the rows asking are a subset the test does not index, e.g. resispec_wor's residual draw
    for the rows still undecided)."""

    def __init__(self, blocks: list) -> None:
        self.blocks = list(blocks)
        self.shapes: list[tuple[int, ...]] = []
        self.fill = 0.5  # what a call past the script gets

    def __call__(self, *size, generator=None, device=None, dtype=None, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        self.shapes.append(shape)
        if not self.blocks:
            return torch.full(shape, self.fill, dtype=dtype or torch.float32)
        block = self.blocks.pop(0)
        if isinstance(block, float):
            return torch.full(shape, block, dtype=dtype or torch.float32)
        return block.to(dtype or torch.float32).reshape(shape)


@contextlib.contextmanager
def scripted(blocks: list, fill: float = 0.5):
    """torch.rand replaced by a ScriptedUniforms of `blocks` (calls past them get `fill`) inside the block."""
    script = ScriptedUniforms(blocks)
    script.fill = fill
    saved, torch.rand = torch.rand, script
    try:
        yield script
    finally:
        torch.rand = saved


# ---------------------------------------------------------------------------------------------- proposals


def inverse_cdf_cells(weights: torch.Tensor) -> list[tuple[int, float, float]]:
    """(token, probability, centre of its uniform interval) for sample_rows on one row of weights (tokens with
    positive weight); a row without mass is one cell: (-1, 1, 0.5)."""
    total = float(weights.sum())
    if total <= 0:
        return [(-1, 1.0, 0.5)]
    cdf = torch.cumsum(weights, 0) / total
    out = []
    for x in range(weights.numel()):
        if weights[x] > 0:
            lo = float(cdf[x - 1]) if x else 0.0
            out.append((x, float(weights[x]) / total, 0.5 * (lo + float(cdf[x]))))
    return out


def proposal_boxes(rule, q: torch.Tensor, n: int):
    """Every draw tuple the rule can propose from q [V], as (tokens [n], probability, uniform blocks per torch.rand
    call [1, k]). The drafting schemes of DESIGN.md: i.i.d. (one call of n uniforms), without replacement (one call
    per draw, q without the earlier draws), hub (top n - 1, one draw from q~), top-n (no randomness)."""
    kind = "iid" if rule.scheme == "iid" else rule.name
    if kind == "iid":
        draws = 1 if rule.name == "chain" else n
        cells = inverse_cdf_cells(q)
        for combo in itertools.product(cells, repeat=draws):
            tokens = [c[0] for c in combo] + [-1] * (n - draws)
            prob = torch.tensor([c[1] for c in combo], dtype=torch.float64).prod().item()
            yield tokens, prob, [torch.tensor([[c[2] for c in combo]], dtype=torch.float64)]
    elif kind in ("rsd", "resispec_wor"):

        def walk(rest, prefix, prob, us):
            if len(prefix) == n:
                yield prefix, prob, [torch.tensor([[u]], dtype=torch.float64) for u in us]
                return
            for x, px, u in inverse_cdf_cells(rest):
                nxt = rest if x < 0 else rest.scatter(0, torch.tensor([x]), 0.0)
                yield from walk(nxt, prefix + [x], prob * px, us + [u])

        yield from walk(q, [], 1.0, [])
    elif kind == "hub":
        top = top_set(q[None], n - 1)[0].tolist()
        _, q_tilde = hub_split(q[None], torch.tensor([top]))
        for x, px, u in inverse_cdf_cells(q_tilde[0]):
            yield top + [x], px, [torch.tensor([[u]], dtype=torch.float64)]
    elif kind in ("onehot", "greedy"):
        yield top_set(q[None], n)[0].tolist(), 1.0, []
    else:
        raise AssertionError(f"no proposal enumeration for {rule.name!r}")


def take(proposal: Proposal, idx: torch.Tensor) -> Proposal:
    """Rows `idx` of a proposal (repeats allowed). An AutoProposal must have all its rows on one branch."""
    cut = {
        f.name: (None if getattr(proposal, f.name) is None else getattr(proposal, f.name)[idx])
        for f in fields(Proposal)
    }
    if isinstance(proposal, AutoProposal):
        mask = proposal.distinct_mask
        assert bool(mask.all()) or not bool(mask.any()), "take() needs an AutoProposal on one branch"
        part = proposal.distinct_part if bool(mask.any()) else proposal.iid_part
        sub = take(part, idx)
        return AutoProposal(
            **cut,
            distinct_mask=mask[idx],
            iid_part=None if bool(mask.any()) else sub,
            distinct_part=sub if bool(mask.any()) else None,
        )
    return type(proposal)(**cut)


def enumerate_proposals(rule, q: torch.Tensor, n: int):
    """(proposal of every draw tuple [T rows], tuple probabilities [T]), made by rule.propose on scripted
    uniforms; checks that propose returns the tuple each box stands for and that the probabilities sum to 1."""
    boxes = list(proposal_boxes(rule, q, n))
    tokens = torch.tensor([b[0] for b in boxes])
    probs = torch.tensor([b[1] for b in boxes], dtype=torch.float64)
    calls = len(boxes[0][2])
    blocks = [torch.cat([b[2][c] for b in boxes]) for c in range(calls)]
    with scripted(blocks) as script:
        proposal = rule.propose(q[None].expand(len(boxes), -1).contiguous(), n, None)
    assert len(script.shapes) == calls, (rule.name, script.shapes)
    assert torch.equal(proposal.token_ids, tokens), rule.name
    assert abs(float(probs.sum()) - 1) < 1e-12
    return proposal, probs


# ---------------------------------------------------------------------------------------------- verification


def search_below(pred, count: int, grid: int | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """sup{u in [0, 1]: pred(u)} for `count` predicates that hold exactly below a threshold -> [count], to 2^-54.
    pred(items [M], u [M]) -> bool [M] evaluates item items[j] at u[j], `chunk` rows per verify call; a grid of
    `grid` points per round (2^k - 1: k halvings a round). None: the grid that makes the fewest rows in all,
    calls padded to `chunk` (few items: 63 points, 9 rounds; thousands: bisection, 54 rounds)."""
    if grid is None:
        grid = min((1, 3, 7, 15, 31, 63), key=lambda g: -(-54 // g.bit_length()) * -(-count * g // chunk))
    lo = torch.zeros(count, dtype=torch.float64)
    hi = torch.ones(count, dtype=torch.float64)
    ticks = torch.arange(1, grid + 1, dtype=torch.float64) / (grid + 1)
    items = torch.arange(count).repeat_interleave(grid)
    rounds = -(-54 // ((grid + 1).bit_length() - 1))  # halvings per round: log2(grid + 1)
    for _ in range(rounds):
        width = hi - lo
        u = (lo[:, None] + width[:, None] * ticks).flatten()
        below = pred(items, u).view(count, grid).sum(-1).double()  # the first `below` grid points hold
        lo, hi = lo + width * below / (grid + 1), lo + width * (below + 1) / (grid + 1)
    return hi


def exact_law(rule, p: torch.Tensor, q: torch.Tensor, n: int, chunk: int = CHUNK) -> torch.Tensor:
    """The law [V] of rule.verify's token, over every draw tuple and every uniform box (module docstring)."""
    proposal, probs = enumerate_proposals(rule, q, n)
    return probs @ tuple_laws(rule, p, proposal, n, chunk)


def tuple_laws(rule, p: torch.Tensor, proposal: Proposal, n: int, chunk: int = CHUNK) -> torch.Tensor:
    """[T, V]: the law of rule.verify's token for each of the proposal's rows (draw tuples), over the uniforms."""
    return outcome_laws(rule, p, proposal, n, chunk).sum(-1)


def outcome_laws(
    rule, p: torch.Tensor, proposal: Proposal, n: int, chunk: int = CHUNK, grid: int | None = None
) -> torch.Tensor:
    """[T, V, 2]: the law of rule.verify's (token, accepted) for each of the proposal's rows (draw tuples), over the
    uniforms; [..., 1] where verify's slot is >= 0 (a draft child accepted: the decoder's walk goes on into it).
    p: [V] for every row or [T, V] per row. `chunk`: rows per verify call (every call padded to it, see CHUNK);
    `grid`: search_below's points per round (None: its choice)."""
    rows = proposal.token_ids.shape[0]
    p_rows = p.expand(rows, -1) if p.dim() == 1 else p
    vocab = p_rows.shape[-1]
    probs = torch.ones(rows, dtype=torch.float64)
    draws = proposal.token_ids

    def verify(idx: torch.Tensor, accept: torch.Tensor, residual, slots: bool = False) -> torch.Tensor:
        """Tokens [N] (with `slots`, slots [N]) of verify on proposal rows idx [N] with acceptance uniforms accept
        [N, k] and the residual draw's uniforms (a tensor [N] or one float for every row); `chunk` rows per call."""
        out = []
        for start in range(0, len(idx), chunk):
            cut = slice(start, start + chunk)
            rows_, acc = idx[cut], accept[cut]
            res = residual if isinstance(residual, float) else residual[cut]
            pad = chunk - len(rows_)
            if pad:  # copies of the first row, discarded
                rows_ = torch.cat([rows_, rows_[:1].expand(pad)])
                acc = torch.cat([acc, acc[:1].expand(pad, -1)])
                res = res if isinstance(res, float) else torch.cat([res, res[:1].expand(pad)])
            with scripted(([acc] if k else []) + [res if isinstance(res, float) else res[:, None]]) as script:
                token, slot = rule.verify(p_rows[rows_].contiguous(), take(proposal, rows_), None)
            assert len(script.shapes) <= k_calls, script.shapes
            out.append((slot if slots else token)[: chunk - pad])
        return torch.cat(out)

    # the calls verify makes: [acceptance uniforms, residual draw] or [residual draw] (onehot) or none (greedy);
    # every test rejecting (uniforms 1.0), so that no call is skipped
    with scripted([], fill=REJECT) as script:
        rule.verify(p_rows.contiguous(), proposal, None)
    k_calls = len(script.shapes)
    k = 0 if k_calls < 2 else int(torch.Size(script.shapes[0]).numel()) // rows
    all_rows = torch.arange(rows)
    law = torch.zeros(rows, vocab, 2, dtype=torch.float64)
    if k_calls == 0:  # deterministic given the draws
        none = torch.empty(rows, 0)
        token, slot = verify(all_rows, none, 0.5), verify(all_rows, none, 0.5, slots=True)
        law[all_rows, token, (slot >= 0).long()] = 1.0
        return law
    # the draw each acceptance uniform tests: hub's one uniform tests its sampled (last) draw
    column = [n - 1] if rule.name == "hub" else list(range(k))

    # thresholds t [rows, k]: bisect u_i with the other uniforms rejecting, under probes that make "accepted"
    # visible (the emitted token differs from x_i once u_i >= t_i): the residual's first or last token, or a later
    # draw accepting
    thresholds = torch.zeros(rows, k, dtype=torch.float64)
    for i in range(k):
        x = draws[:, column[i]]
        probes = [(None, 0.0), (None, 1.0 - 1e-12)] + [(j, 0.5) for j in range(i + 1, k)]
        pending = torch.ones(rows, dtype=torch.bool)
        for later, r in probes:
            idx = pending.nonzero()[:, 0]
            if not len(idx):
                break

            def emits_x(rows_, u, later=later, r=r, i=i, x=x):
                acc = torch.full((len(rows_), k), REJECT, dtype=torch.float64)
                acc[:, i] = u
                if later is not None:
                    acc[:, later] = 0.0
                return verify(rows_, acc, r) == x[rows_]

            visible = ~emits_x(idx, torch.full((len(idx),), REJECT, dtype=torch.float64))
            idx_v = idx[visible]
            if not len(idx_v):
                continue
            thresholds[idx_v, i] = search_below(
                lambda items, u, idx_v=idx_v: emits_x(idx_v[items], u), len(idx_v), grid, chunk
            )
            pending[idx_v] = False
        # rows where no probe shows the test: every path emits x_i either way, so one box [0, 1) serves

    # the residual's law where every test rejected: per token v, the largest uniform emitting a token <= v
    rep = all_rows.repeat_interleave(vocab)
    v = torch.arange(vocab).repeat(rows)

    def reject_all(count: int) -> torch.Tensor:
        return torch.full((count, k), REJECT, dtype=torch.float64)

    def emits_at_most_v(items, u):
        return verify(rep[items], reject_all(len(items)), u) <= v[items]

    cdf = search_below(emits_at_most_v, rows * vocab, grid, chunk).view(rows, vocab)
    residual_law = torch.diff(cdf, dim=1, prepend=torch.zeros(rows, 1, dtype=torch.float64))
    # the slot of each residual token: verify at the middle of its interval
    cells = (residual_law.flatten() > 0).nonzero()[:, 0]
    mid = (cdf.flatten() - residual_law.flatten() / 2)[cells]
    hit = (verify(rep[cells], reject_all(len(cells)), mid, slots=True) >= 0).long()

    none_accepted = probs * (1 - thresholds).prod(-1)
    law.view(-1, 2)[cells, hit] = (none_accepted[:, None] * residual_law).flatten()[cells]
    # every other accept/reject pattern: the centre of its box, with the residual draw at any value
    for pattern in itertools.product((True, False), repeat=k):
        if not any(pattern):
            continue
        acc_bits = torch.tensor(pattern)
        width = torch.where(acc_bits, thresholds, 1 - thresholds).prod(-1) * probs
        idx = (width > 0).nonzero()[:, 0]
        if not len(idx):
            continue
        u = torch.where(acc_bits, thresholds[idx] / 2, (1 + thresholds[idx]) / 2)
        token, slot = verify(idx, u, 0.5), verify(idx, u, 0.5, slots=True)
        assert bool((token >= 0).all()), rule.name
        law[idx, token, (slot >= 0).long()] += width[idx]
    return law
