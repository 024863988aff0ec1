"""Shared pieces of the verification rules: the Proposal record, the rule Protocol, input checks, sampling.

Conventions (every rule follows them, the decoder relies on them):
- p, q: [B, V] probabilities after the SAME temperature / top-k / top-p processing; float32 or float64; any device.
- proposal.token_ids: [B, n] LongTensor in draw order. `-1` marks an EMPTY draw slot: a distinct scheme whose q has
  fewer than n tokens of positive mass (its draws stop at the support), or `chain` (one draw) asked for n > 1.
  The decoder must skip -1 (no child node).
- i.i.d. schemes may repeat a token; repeated draws are ONE child node.
- verify returns (token [B], slot [B]); slot is the index of the FIRST draw equal to the emitted token, or -1 when
  the emitted token is not among the draws (rejection: the token is the correction token). With repeated i.i.d.
  draws the draw that verification accepted can be a later copy of an earlier (rejected) draw of the same token;
  slot still names the first copy, i.e. the merged child node. slot >= 0 <=> the emitted token is a child.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from resispec.sampling import sample_rows, standard_gumbel

Tensor = torch.Tensor
SCHEMES = ("iid", "distinct", "deterministic")


@dataclass
class Proposal:
    """The draws of a batch of nodes plus what their verification needs.

    token_ids: [B, n] draws in draw order (-1 = empty slot). q: [B, V] the draft distribution they came from.
    draw_probs: [B, n] (rsd) probability of each draw under the draw-time conditional q_i (q without the
        earlier draws, renormalised); 0 for empty slots.
    noise: [B, V] (gumbel, rsd) the Gumbel noise G of the draws; gumbel reuses it to emit argmax(log p + G).
    top_ids: [B, n - 1] (hub) the fixed top set of q (-1 = empty).
    """

    token_ids: Tensor  # [B, n] long
    q: Tensor  # [B, V]
    draw_probs: Tensor | None = None  # [B, n]
    noise: Tensor | None = None  # [B, V]
    top_ids: Tensor | None = None  # [B, n - 1]

    @property
    def num_draws(self) -> int:
        return self.token_ids.shape[-1]

    def select(self, row: int) -> Proposal:
        """The proposal of one node (row `row`) alone: every [B, ...] field cut to [1, ...]. Verifying it with that
        node's p is the same as verifying the whole batch and reading that row (rows are independent)."""
        cut = lambda x: None if x is None else x[row : row + 1]  # noqa: E731
        return Proposal(
            token_ids=cut(self.token_ids),
            q=cut(self.q),
            draw_probs=cut(self.draw_probs),
            noise=cut(self.noise),
            top_ids=cut(self.top_ids),
        )

    @classmethod
    def cat(cls, parts: list[Proposal]) -> Proposal:
        """The rows of `parts` (proposals of one rule with the same number of draws) as one proposal, in order:
        verifying it is verifying each part (rows are independent). A subclass with fields of its own overrides it
        (AutoProposal does); the decoder's walk joins the proposals of a chain's levels with it."""

        def join(name: str, fill: float) -> Tensor | None:
            xs = [getattr(x, name) for x in parts]
            ref = next((x for x in xs if x is not None), None)
            if ref is None:
                return None
            # a field that only some parts carry (resispec_auto's noise: its i.i.d. rows have none) is filled as
            # its convention has it for the rows without: noise 0, draw_probs 0, top_ids -1
            return torch.cat(
                [
                    ref.new_full((part.token_ids.shape[0], *ref.shape[1:]), fill) if x is None else x
                    for part, x in zip(parts, xs, strict=True)
                ]
            )

        return cls(
            token_ids=join("token_ids", -1),
            q=join("q", 0.0),
            draw_probs=join("draw_probs", 0.0),
            noise=join("noise", 0.0),
            top_ids=join("top_ids", -1),
        )


@runtime_checkable
class VerificationRule(Protocol):
    """What the decoder, the losses and the benchmarks use. `scheme`: "iid" | "distinct" | "deterministic".

    Declared capabilities (callers read them instead of catching NotImplementedError):
    closed_form_draws: the largest n for which `acceptance` is a closed form (None = every n; 0 = none: estimate
        by sampling, resispec.verify.estimate);
    surrogate_draws: the same for `surrogate_acceptance`, the value training losses and checkpoint selection use
        (the closed form itself, or for a rule that drafts per node a closed-form stand-in: verify/auto.py);
    greedy_only: exact only for one-hot p (temperature 0), like `greedy`; such rules are skipped where p is not.
    """

    name: str
    scheme: str
    closed_form_draws: int | None
    surrogate_draws: int | None
    greedy_only: bool

    def propose(self, q: Tensor, n: int, generator: torch.Generator | None = None) -> Proposal: ...

    def verify(
        self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]: ...

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor: ...

    def surrogate_acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor: ...


def covers(draws: int | None, n: int) -> bool:
    """Whether a declared capability (`closed_form_draws`, `surrogate_draws`) holds at n draws."""
    return draws is None or n <= draws


# ---------------------------------------------------------------------------------------------- checks


def check_draws(n: int) -> int:
    """n must be a positive int (the number of draws of a node)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of draws n must be an int >= 1, got {n!r}")
    return n


def check_pair(p: Tensor, q: Tensor) -> None:
    """p and q: same shape [B, V], floating, same dtype and device."""
    if p.dim() != 2 or p.shape != q.shape:
        raise ValueError(f"p and q must both be [B, V]; got {tuple(p.shape)} and {tuple(q.shape)}")
    if not p.is_floating_point() or p.dtype != q.dtype or p.device != q.device:
        raise ValueError(
            f"p and q must share a floating dtype and device; got {p.dtype}/{p.device}, {q.dtype}/{q.device}"
        )


def check_dist(x: Tensor, what: str) -> None:
    """x [B, V]: floating, at least one positive entry per row (rows need not be normalised exactly)."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(
            f"{what} must be a floating [B, V] tensor of probabilities, got {x.dtype} {tuple(x.shape)}"
        )


# ---------------------------------------------------------------------------------------------- randomness


def uniform(shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    """U[0, 1) of `like`'s dtype and device."""
    return torch.rand(shape, generator=generator, device=like.device, dtype=like.dtype)


def gumbel_noise(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard Gumbel noise of `like`'s shape, dtype and device (resispec.sampling.standard_gumbel)."""
    return standard_gumbel(tuple(like.shape), generator, like.device, like.dtype)


def sample_weights(
    weights: Tensor, generator: torch.Generator | None, fallback: Tensor, u: Tensor | None = None
) -> Tensor:
    """One token per row from unnormalised weights [B, V] -> [B] (u: the uniforms [B, 1], else drawn here).

    A row whose weights are all 0 can only be reached through float rounding (it would have been accepted with
    probability 1 in exact arithmetic); it samples from `fallback` [B, V] instead of failing."""
    total = weights.sum(-1, keepdim=True)  # [B, 1]
    return sample_rows(torch.where(total > 0, weights, fallback), 1, generator, u)[:, 0]


def sample_rejected(
    accepted: Tensor,
    weights: Callable[[], Tensor],
    generator: torch.Generator | None,
    fallback: Tensor,
    u: Tensor | None = None,
) -> Tensor:
    """sample_weights(weights(), generator, fallback, u): the token [B] each row emits if its draws were all
    rejected (accepted [B] bool: a draw of the row was accepted), to be discarded where one was. On CPU, when every
    row accepted (a host check that costs nothing there; on a GPU it would be a sync), the [B, V] weights are not
    built and -1 stands for every row; the rejection sample's uniforms are still drawn, so the random stream, and
    every later draw, is the full computation's."""
    if accepted.device.type == "cpu" and bool(accepted.all()):
        if u is None:
            uniform((accepted.shape[0], 1), fallback, generator)
        return torch.full(accepted.shape, -1, dtype=torch.long)
    return sample_weights(weights(), generator, fallback, u)


def draw_iid(q: Tensor, n: int, generator: torch.Generator | None) -> Tensor:
    """n i.i.d. draws from q [B, V] -> [B, n]."""
    return sample_rows(q, n, generator)


def draw_distinct(q: Tensor, n: int, generator: torch.Generator | None) -> Tensor:
    """n draws WITHOUT replacement from q [B, V], in draw order -> [B, n]; -1 once a row's support is exhausted.
    Draw i is an inverse-CDF draw from q restricted to the tokens not drawn yet: the law of Gumbel-top-n
    (distinct.gumbel_top), with one uniform per draw instead of V exponentials per row (on CPU, where an
    exponential costs ~25 ns: 3x cheaper at 4 rows x 2 draws, 12x at 8 x 1, even at 1 x 4, V = 8192). For the
    rules that never read the Gumbel noise (rsd, resispec_wor)."""
    rest, draws = q, []
    for i in range(n):
        left = rest.sum(-1) > 0  # [B]; rest holds exact q values or exact zeros
        # never a zero-weight token (token 0 for a row without mass left, replaced by -1 below)
        x = sample_rows(rest, 1, generator)[:, 0]
        draws.append(torch.where(left, x, -1))
        if i + 1 < n:
            rest = rest.scatter(-1, x[:, None], 0.0)
    return torch.stack(draws, -1)


def top_distinct(keys: Tensor, support: Tensor, n: int) -> Tensor:
    """The n largest `keys` [B, V] among `support` [B, V] (bool), in decreasing key order -> [B, n];
    slots past the support are -1 (and n > V is allowed)."""
    k = min(n, keys.shape[-1])
    masked = keys.masked_fill(~support, float("-inf"))
    vals, idx = masked.topk(k, dim=-1)  # [B, k]
    idx = torch.where(vals > float("-inf"), idx, torch.full_like(idx, -1))
    if k < n:
        idx = torch.cat([idx, idx.new_full((idx.shape[0], n - k), -1)], dim=-1)
    return idx


def top_set(q: Tensor, k: int) -> Tensor:
    """The k largest entries of q [B, V], ties broken toward the LOWEST index (so the set is deterministic and
    may include q = 0 tokens when q has fewer than k positive entries) -> ids [B, k]; -1 pads k > V."""
    vocab = q.shape[-1]
    kk = min(k, vocab)
    if kk == 0:
        return q.new_full((q.shape[0], k), -1, dtype=torch.long)
    thr = q.topk(kk, dim=-1).values[:, -1:]  # [B, 1] the k-th largest value
    above = q > thr
    tied = q == thr
    need = kk - above.sum(-1, keepdim=True)
    pick = above | (tied & (torch.cumsum(tied.to(torch.int32), -1) <= need))  # exactly kk per row
    keys = torch.where(pick, q, torch.full_like(q, float("-inf")))
    ids = keys.topk(kk, dim=-1).indices  # the picked set, in decreasing q
    if kk < k:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], k - kk), -1)], dim=-1)
    return ids


def gather_at(x: Tensor, ids: Tensor) -> Tensor:
    """x [B, V] at ids [B, k] (-1 allowed: gives 0) -> [B, k]."""
    vals = x.gather(-1, ids.clamp_min(0))
    return torch.where(ids >= 0, vals, torch.zeros_like(vals))


def id_mask(ids: Tensor, vocab: int) -> Tensor:
    """Bool membership mask [B, V] of ids [B, k] (-1 entries ignored)."""
    mask = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(-1, torch.where(ids >= 0, ids, torch.full_like(ids, vocab)), True)
    return mask[:, :vocab]


def first_slot(tokens: Tensor, token: Tensor) -> Tensor:
    """Index of the first draw equal to `token`, -1 if none. tokens [B, n], token [B] -> [B]."""
    hit = tokens == token[:, None]  # [B, n]
    n = tokens.shape[-1]
    idx = torch.arange(n, device=tokens.device).expand_as(tokens)
    first = torch.where(hit, idx, torch.full_like(idx, n)).min(-1).values
    return torch.where(first < n, first, torch.full_like(first, -1))
