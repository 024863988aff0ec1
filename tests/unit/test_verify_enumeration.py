"""Exactness by enumeration (DESIGN.md, "Exactness tests every rule must pass"): for every rule of the registry and
every reference case (tests/data/verify_cases.json: V <= 8, n <= 4), the EXACT law of the emitted token, computed
from the rule's own propose and verify, equals p to 1e-9.

How the law is made exact. Every rule draws its randomness as torch.rand uniforms (sampling.sample_rows' inverse
CDF, base.uniform's acceptance tests, the residual draw). During these tests `torch.rand` is replaced by a script
(ScriptedUniforms) that hands each call the uniforms the test chooses, so the rule runs unchanged on chosen points:
- propose: the draws are inverse-CDF samples, so each draw tuple is one box of uniforms with known side lengths
  (q(x) / remaining mass); the test feeds each box's centre and checks that propose returns that tuple, whose
  probability is the box's volume;
- verify: each acceptance uniform u_i is compared against one threshold t_i (accept iff u_i < t_i) that depends on
  the draws only; t_i is located by bisection on verify's own output (the other draws rejected, several probes so a
  coincidence of tokens cannot hide it); every accept/reject pattern of the n uniforms is then a box of known volume
  whose centre is fed to verify. The all-rejected box ends in the residual draw, again an inverse CDF: its law is read
  off by bisecting, per token, the largest uniform that emits a token <= it.
The searches stop at 2^-54 (float64 uniforms are multiples of 2^-53): the boxes' volumes are exact to ~1e-16, far
inside 1e-9.

gumbel (and resispec_auto where it takes gumbel) draws Gumbel noise, a continuous variable with no boxes: there the
test checks the identity the law rests on, verify's token = argmax(log p + G) for the proposal's own noise G (the
Gumbel-max law is p), and that the drafted children are the top-n of log q + G.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from resispec.verify import VERIFIERS
from resispec.verify.auto import AutoProposal
from resispec.verify.base import Proposal, top_set
from resispec.verify.distinct import hub_split

CASES = json.loads((Path(__file__).resolve().parents[1] / "data" / "verify_cases.json").read_text())["cases"]
TOL = 1e-9
GRID, ROUNDS = 63, 9  # the threshold searches: 63 points (6 halvings) per verify call, 9 calls: to 2^-54
# rows per verify call, ALWAYS (short calls are padded): a row's output may depend on the batch size (resispec's T is
# located by a grid whose size follows the batch; where g(T) is flat at 0, float noise picks different points of the
# flat part, all exact but each with its own plan), so every call of one enumeration must see the same batch size
CHUNK = 1 << 12
# the default run enumerates the cases with at most this many draw tuples (V^n): 34 of the 45, every n (n = 4 at
# V = 4, V = 8 at n = 2), ~2k tuples against ~15k for all; the slow test takes every case
DEFAULT_MAX_TUPLES = 256
REJECT = 1.0  # an acceptance uniform that rejects (u < t is false for every t <= 1)

pytestmark = pytest.mark.usefixtures("one_thread")


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


def scripted(monkeypatch, blocks: list) -> ScriptedUniforms:
    script = ScriptedUniforms(blocks)
    monkeypatch.setattr(torch, "rand", script)
    return script


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


def enumerate_proposals(monkeypatch, rule, q: torch.Tensor, n: int):
    """(proposal of every draw tuple [T rows], tuple probabilities [T]), made by rule.propose on scripted
    uniforms; checks that propose returns the tuple each box stands for and that the probabilities sum to 1."""
    boxes = list(proposal_boxes(rule, q, n))
    tokens = torch.tensor([b[0] for b in boxes])
    probs = torch.tensor([b[1] for b in boxes], dtype=torch.float64)
    calls = len(boxes[0][2])
    blocks = [torch.cat([b[2][c] for b in boxes]) for c in range(calls)]
    script = scripted(monkeypatch, blocks)
    proposal = rule.propose(q[None].expand(len(boxes), -1).contiguous(), n, None)
    monkeypatch.undo()
    assert len(script.shapes) == calls, (rule.name, script.shapes)
    assert torch.equal(proposal.token_ids, tokens), rule.name
    assert abs(float(probs.sum()) - 1) < 1e-12
    return proposal, probs


# ---------------------------------------------------------------------------------------------- verification


def search_below(pred, count: int) -> torch.Tensor:
    """sup{u in [0, 1]: pred(u)} for `count` predicates that hold exactly below a threshold -> [count], to 2^-54.
    pred(items [M], u [M]) -> bool [M] evaluates item items[j] at u[j]; a grid of GRID points per round (one call)."""
    lo = torch.zeros(count, dtype=torch.float64)
    hi = torch.ones(count, dtype=torch.float64)
    ticks = torch.arange(1, GRID + 1, dtype=torch.float64) / (GRID + 1)
    items = torch.arange(count).repeat_interleave(GRID)
    for _ in range(ROUNDS):
        width = hi - lo
        u = (lo[:, None] + width[:, None] * ticks).flatten()
        below = pred(items, u).view(count, GRID).sum(-1).double()  # the first `below` grid points hold
        lo, hi = lo + width * below / (GRID + 1), lo + width * (below + 1) / (GRID + 1)
    return hi


def exact_law(monkeypatch, rule, p: torch.Tensor, q: torch.Tensor, n: int) -> torch.Tensor:
    """The law [V] of rule.verify's token, over every draw tuple and every uniform box (module docstring)."""
    proposal, probs = enumerate_proposals(monkeypatch, rule, q, n)
    return probs @ tuple_laws(monkeypatch, rule, p, proposal, n)


def tuple_laws(monkeypatch, rule, p: torch.Tensor, proposal: Proposal, n: int) -> torch.Tensor:
    """[T, V]: the law of rule.verify's token for each of the proposal's rows (draw tuples), over the uniforms."""
    rows, vocab = proposal.token_ids.shape[0], p.numel()
    probs = torch.ones(rows, dtype=torch.float64)
    draws = proposal.token_ids

    def verify(idx: torch.Tensor, accept: torch.Tensor, residual) -> torch.Tensor:
        """Tokens [N] of verify on proposal rows idx [N] with acceptance uniforms accept [N, k] and the residual
        draw's uniforms (a tensor [N] or one float for every row); CHUNK rows per call."""
        out = []
        for start in range(0, len(idx), CHUNK):
            cut = slice(start, start + CHUNK)
            rows_, acc = idx[cut], accept[cut]
            res = residual if isinstance(residual, float) else residual[cut]
            pad = CHUNK - len(rows_)
            if pad:  # copies of the first row, discarded
                rows_ = torch.cat([rows_, rows_[:1].expand(pad)])
                acc = torch.cat([acc, acc[:1].expand(pad, -1)])
                res = res if isinstance(res, float) else torch.cat([res, res[:1].expand(pad)])
            script = scripted(
                monkeypatch, ([acc] if k else []) + [res if isinstance(res, float) else res[:, None]]
            )
            token, _ = rule.verify(p[None].expand(CHUNK, -1).contiguous(), take(proposal, rows_), None)
            monkeypatch.undo()
            assert len(script.shapes) <= k_calls, script.shapes
            out.append(token[: CHUNK - pad])
        return torch.cat(out)

    # the calls verify makes: [acceptance uniforms, residual draw] or [residual draw] (onehot) or none (greedy);
    # every test rejecting (uniforms 1.0), so that no call is skipped
    script = scripted(monkeypatch, [])
    script.fill = REJECT
    rule.verify(p[None].expand(rows, -1).contiguous(), proposal, None)
    monkeypatch.undo()
    k_calls = len(script.shapes)
    k = 0 if k_calls < 2 else int(torch.Size(script.shapes[0]).numel()) // rows
    all_rows = torch.arange(rows)
    if k_calls == 0:  # deterministic given the draws
        token = verify(all_rows, torch.empty(rows, 0), 0.5)
        return torch.nn.functional.one_hot(token, vocab).double()
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
                lambda items, u, idx_v=idx_v: emits_x(idx_v[items], u), len(idx_v)
            )
            pending[idx_v] = False
        # rows where no probe shows the test: every path emits x_i either way, so one box [0, 1) serves

    # the residual's law where every test rejected: per token v, the largest uniform emitting a token <= v
    rep = all_rows.repeat_interleave(vocab)
    v = torch.arange(vocab).repeat(rows)

    def emits_at_most_v(items, u):
        reject_all = torch.full((len(items), k), REJECT, dtype=torch.float64)
        return verify(rep[items], reject_all, u) <= v[items]

    cdf = search_below(emits_at_most_v, rows * vocab).view(rows, vocab)
    residual_law = torch.diff(cdf, dim=1, prepend=torch.zeros(rows, 1, dtype=torch.float64))

    none_accepted = probs * (1 - thresholds).prod(-1)
    law = none_accepted[:, None] * residual_law  # [T, V]
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
        token = verify(idx, u, 0.5)
        assert bool((token >= 0).all()), rule.name
        law[idx, token] += width[idx]
    return law


def _pairs(case: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    return (
        torch.tensor(case["p"], dtype=torch.float64),
        torch.tensor(case["q"], dtype=torch.float64),
        case["n"],
    )


ENUMERATED = [name for name in sorted(VERIFIERS) if name not in ("gumbel", "greedy")]


def check_every_case(name: str, monkeypatch, max_tuples: int | None) -> int:
    """The exact law of rule `name` on the reference cases with at most max_tuples draw tuples (None: all), at the
    case's n and at n = 1 -> the number of (case, n) checked."""
    rule = VERIFIERS[name]
    checked = 0
    for c, case in enumerate(CASES):
        p, q, n = _pairs(case)
        if max_tuples is not None and len(case["p"]) ** n > max_tuples:
            continue
        for draws in sorted({1, n}):
            if name == "resispec_auto" and bool(rule.policy.distinct_rows(q[None], draws)[0]):
                continue
            law = exact_law(monkeypatch, rule, p, q, draws)
            err = float((law - p).abs().max())
            assert err < TOL, (name, c, draws, err, law.tolist(), p.tolist())
            checked += 1
    return checked


@pytest.mark.timeout(900)  # 5-60 s per rule alone; several minutes when the 2 cores are shared by many jobs
@pytest.mark.parametrize("name", ENUMERATED)
def test_exact_output_law_is_p_on_the_reference_cases(name, monkeypatch):
    """The reference cases up to 256 draw tuples (34 of 45: V <= 8, n <= 4, every n), each at its own n and at
    n = 1: the law of the emitted token, computed exactly from the rule's propose and verify, is p to 1e-9.
    resispec_auto runs on both its branches' cases: rows its policy sends to gumbel are covered by the Gumbel test
    below."""
    assert check_every_case(name, monkeypatch, DEFAULT_MAX_TUPLES) >= 30


@pytest.mark.slow  # ~15k draw tuples per rule: minutes per rule
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", ENUMERATED)
def test_exact_output_law_is_p_on_every_reference_case(name, monkeypatch):
    """As above, on all 45 cases (up to 4096 draw tuples: V = 8, n = 4)."""
    assert check_every_case(name, monkeypatch, None) >= len(CASES)


def test_greedy_emits_the_argmax_with_probability_one(monkeypatch):
    """greedy is exact for one-hot p (temperature 0): the enumerated law is that point mass."""
    rule = VERIFIERS["greedy"]
    for case in CASES[:10]:
        p, q, n = _pairs(case)
        onehot = torch.zeros_like(p)
        onehot[int(p.argmax())] = 1.0
        law = exact_law(monkeypatch, rule, onehot, q, n)
        assert float((law - onehot).abs().max()) < TOL


@pytest.mark.parametrize("name", ["gumbel", "resispec_auto"])
def test_gumbel_verification_is_the_gumbel_max_of_p(name):
    """Gumbel draws have no boxes: the law is exact because verify emits argmax(log p + G) with the proposal's
    own noise G (a standard Gumbel vector, so the token's law is p) and the children are the top-n of log q + G.
    Checked on every reference case with confident q for resispec_auto (its gumbel branch), 200 noise draws each."""
    rule = VERIFIERS[name]
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for case in CASES:
        p, q, n = _pairs(case)
        if n < 2:
            continue
        if name == "resispec_auto" and not bool(rule.policy.distinct_rows(q[None], n)[0]):
            continue
        pp, qq = p[None].expand(200, -1), q[None].expand(200, -1)
        proposal = rule.propose(qq, n, gen)
        noise = proposal.noise
        assert noise is not None
        token, slot = rule.verify(pp, proposal, gen)
        assert torch.equal(token, (p.log() + noise).argmax(-1))
        keys = torch.where(qq > 0, qq.log() + noise, torch.tensor(float("-inf"), dtype=torch.float64))
        top = keys.topk(n, -1).indices
        valid = proposal.token_ids >= 0
        assert torch.equal(torch.where(valid, proposal.token_ids, top), top)
        hit = (proposal.token_ids == token[:, None]).any(-1)
        assert torch.equal(slot >= 0, hit)
        checked += 1
    assert checked > 0


def test_enumeration_sees_a_rule_that_emits_its_first_draft_too_often(monkeypatch):
    """The enumeration's power: resispec planted with a defect, emitting its first draft where it would emit one
    given token v (the least likely under p, ~3% of the nodes here), moves the exact law by about p(v) q-weighted,
    many orders of magnitude above the tolerance; the unplanted rule passes on the same case (test above)."""
    rule = VERIFIERS["resispec"]
    p, q, n = _pairs(next(c for c in CASES if c["n"] == 3 and min(c["p"]) > 0.01))
    v = int(p.argmin())

    class Planted:
        name, scheme = "resispec", "iid"

        def propose(self, q, n, generator=None):
            return rule.propose(q, n, generator)

        def verify(self, p, proposal, generator=None):
            token, slot = rule.verify(p, proposal, generator)
            cheat = token == v
            return torch.where(cheat, proposal.token_ids[:, 0], token), torch.where(cheat, 0, slot)

    law = exact_law(monkeypatch, Planted(), p, q, n)
    assert float((law - p).abs().max()) > 1e3 * TOL, (law - p).tolist()
    assert float((exact_law(monkeypatch, rule, p, q, n) - p).abs().max()) < TOL
