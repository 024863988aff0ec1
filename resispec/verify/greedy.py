"""The temperature-0 rule: children = the top-n of q, emitted token = argmax p, accepted iff it is a child.

At temperature 0 the decoder's p is one-hot (resispec.sampling.probs), and every exact rule then emits argmax p
with probability 1; this rule does exactly that without the arithmetic. It is exact ONLY for one-hot p
(`greedy_only = True`): the decoder uses it at temperature 0, and tests feed it one-hot targets.
"""

from __future__ import annotations

import torch

from resispec.verify.base import Proposal, Tensor, check_draws, check_pair, first_slot, top_set


class GreedyRule:
    """Deterministic drafting (top-n of q, ties toward the lowest id, -1 past V) and argmax verification."""

    name = "greedy"
    scheme = "deterministic"
    closed_form_draws: int | None = None
    surrogate_draws: int | None = None
    greedy_only = True

    def __repr__(self) -> str:
        return f"<verification rule {self.name!r} ({self.scheme})>"

    def propose(self, q: Tensor, n: int, generator: torch.Generator | None = None) -> Proposal:
        return Proposal(token_ids=top_set(q, check_draws(n)), q=q)  # [B, n]

    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        check_pair(p, proposal.q)
        token = p.argmax(dim=-1)  # [B]
        return token, first_slot(proposal.token_ids, token)

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        """1 where argmax p is among the top-n of q, else 0 -> [B] (for one-hot p: p(top-n of q), as onehot)."""
        check_pair(p, q)
        hit = first_slot(top_set(q.detach(), check_draws(n)), p.argmax(dim=-1)) >= 0
        return hit.to(p.dtype)

    def surrogate_acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        return self.acceptance(p, q, n)
