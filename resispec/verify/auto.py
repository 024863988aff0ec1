"""resispec_auto: choose the drafting scheme and the verification rule PER NODE from draft-side information only.

When the draft is unsure (flat q), i.i.d. draws with residual shaping (`resispec`) accept most; when it is confident,
i.i.d. draws repeat the top token and distinct draws (`gumbel`, `rsd` or `resispec_wor`) cover more. At ONE draw
there is nothing to cover: every row takes the i.i.d. branch (standard speculative sampling, the optimal coupling). q is known
before drafting, so a choice that looks only at q (and n) keeps every node exact: each row is an exact rule.

    rule = VERIFIERS["resispec_auto"]                # default_policy(): gumbel where max q >= 0.3 (0.4 at n = 2)
    rule = build_rule("resispec_auto", "auto_policy.json")   # a calibrated policy (resispec.verify.registry)
    proposal = rule.propose(q, n, generator)         # AutoProposal: token_ids [B, n] + which branch each row took
    token, slot = rule.verify(p, proposal, generator)
    alpha = rule.acceptance(p, q, n)                 # exact; raises if a row's branch has no closed form
    alpha = rule.surrogate_acceptance(p, q, n)       # the training surrogate: closed form on every row (below)

Policy (`AutoPolicy`): a feature of q (`max_q` or `entropy`, in nats) against a threshold, plus the two rules to
use; threshold and distinct rule can be set per n (the small table `python bench/headroom.py` calibrates). The rule
API gives no depth, so the policy uses q and n only. The policy is plain data: the decoder, server and bench take it
from `decode.auto_policy` (a JSON path or inline values) through `build_rule`; each call builds its own rule object,
so two policies coexist in one process. The branch rules are injected (`ResiSpecAutoRule(policy, iid=, distinct=)`).

acceptance: rows on the i.i.d. branch get resispec's closed form, sum min(p, T* q). Rows on the distinct branch
get that rule's closed form when it has one (resispec_wor, n <= 2). gumbel and rsd have none: `acceptance` then
raises NotImplementedError (like gumbel and rsd themselves), and `surrogate_acceptance` returns, on those rows, the
resispec closed form, i.e. what the node would accept had it drafted i.i.d. That surrogate is what a residual
training loss and checkpoint selection use (`surrogate_draws` = the i.i.d. branch's closed-form range); on those rows the real
per-node alpha is usually higher (that is why the policy chose distinct draws). The headroom tool measures the
real value by Monte Carlo.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from resispec.verify.base import Proposal, Tensor, VerificationRule, check_draws, check_pair, covers

FEATURES = ("max_q", "entropy")


def confidence_feature(q: Tensor, feature: str) -> Tensor:
    """Draft-side feature per row: max q, or the entropy of q in nats. q [B, V] -> [B]."""
    if feature == "max_q":
        return q.max(-1).values
    if feature == "entropy":
        logq = torch.where(q > 0, q.log(), torch.zeros_like(q))
        return -(q * logq).sum(-1)
    raise ValueError(f"unknown auto feature {feature!r}; choose one of {FEATURES}")


@dataclass
class AutoPolicy:
    """Distinct draws where the draft is confident: max_q >= threshold, or entropy <= threshold.

    thresholds, distinct_rules: per-n overrides (JSON keys are strings); n not listed uses `threshold` and
    `distinct_rule`. At n = 1 no row is ever distinct (distinct_rows). The registry's default is DEFAULT_POLICY."""

    feature: str = "max_q"
    threshold: float = 0.3
    thresholds: dict[int, float] = field(default_factory=dict)
    iid_rule: str = "resispec"
    distinct_rule: str = "gumbel"
    distinct_rules: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.feature not in FEATURES:
            raise ValueError(f"unknown auto feature {self.feature!r}; choose one of {FEATURES}")
        self.thresholds = {int(k): float(v) for k, v in self.thresholds.items()}
        self.distinct_rules = {int(k): str(v) for k, v in self.distinct_rules.items()}

    def threshold_for(self, n: int) -> float:
        return self.thresholds.get(n, self.threshold)

    def distinct_rule_for(self, n: int) -> str:
        return self.distinct_rules.get(n, self.distinct_rule)

    def distinct_rows(self, q: Tensor, n: int) -> Tensor:
        """Bool [B]: rows that draft distinct tokens. q [B, V]. None at n = 1: one draw is the same draw under every
        scheme, and the i.i.d. rule's one-draw step (standard speculative sampling) accepts sum min(p, q), the most
        any coupling of one draw can; gumbel's coupling accepts less (V = 16: .318 against .406)."""
        if n == 1:
            return torch.zeros(q.shape[:-1], dtype=torch.bool, device=q.device)
        f = confidence_feature(q.detach(), self.feature)
        t = self.threshold_for(n)
        return f >= t if self.feature == "max_q" else f <= t

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> AutoPolicy:
        return cls(**json.loads(Path(path).read_text()))


def default_policy() -> AutoPolicy:
    """The policy resispec_auto runs without one: max q >= 0.3, except n = 2 at 0.4. With two draws gumbel at max q
    in [0.3, 0.4) accepts less than resispec: the policy at 0.3 fell below resispec on random pairs (V = 16, logits
    N(0, 1): .8072 against .8093, 2000 nodes); with 0.4 at n = 2 it is above both branches for n = 2, 3, 4 at every
    logit scale tried (0.5 to 3). A policy given explicitly (decode.auto_policy, a calibrated JSON) is used as is."""
    return AutoPolicy(thresholds={2: 0.4})


@dataclass
class AutoProposal(Proposal):
    """A Proposal whose rows came from two rules. distinct_mask [B] bool; the sub-proposals hold their rows
    in the order of `distinct_mask.nonzero()` (distinct) and `(~distinct_mask).nonzero()` (i.i.d.)."""

    distinct_mask: Tensor | None = None  # [B] bool
    iid_part: Proposal | None = None
    distinct_part: Proposal | None = None

    def select(self, row: int) -> AutoProposal:
        """Row `row` alone, with its branch's sub-proposal row (the branch rows keep their relative order)."""
        mask = self.distinct_mask
        is_distinct = bool(mask[row])
        part = self.distinct_part if is_distinct else self.iid_part
        sub = part.select(int((mask[:row] == is_distinct).sum()))
        return AutoProposal(
            token_ids=self.token_ids[row : row + 1],
            q=self.q[row : row + 1],
            noise=None if self.noise is None else self.noise[row : row + 1],
            distinct_mask=mask[row : row + 1],
            iid_part=None if is_distinct else sub,
            distinct_part=sub if is_distinct else None,
        )

    @classmethod
    def cat(cls, parts: list[AutoProposal]) -> AutoProposal:
        """The rows of `parts` in order, each branch's sub-proposal rows joined in the same order."""
        base = Proposal.cat(parts)

        def branch(name: str) -> Proposal | None:
            subs = [getattr(x, name) for x in parts if getattr(x, name) is not None]
            return type(subs[0]).cat(subs) if subs else None

        return cls(
            token_ids=base.token_ids,
            q=base.q,
            noise=base.noise,
            distinct_mask=torch.cat([x.distinct_mask for x in parts]),
            iid_part=branch("iid_part"),
            distinct_part=branch("distinct_part"),
        )


class ResiSpecAutoRule:
    """Per-node choice between an i.i.d. and a distinct drafting scheme (module docstring)."""

    scheme = "iid"  # per row it is "iid" or "distinct"; the proposal's distinct_mask says which
    greedy_only = False

    def __init__(
        self,
        policy: AutoPolicy | None,
        iid: VerificationRule,
        distinct: Mapping[str, VerificationRule],
        name: str = "resispec_auto",
    ) -> None:
        """policy: None = default_policy(). iid: the rule named policy.iid_rule. distinct: the distinct rules
        by name, covering every rule the policy names."""
        self.policy = policy or default_policy()
        self.name = name
        names = {self.policy.distinct_rule, *self.policy.distinct_rules.values()}
        if iid.name != self.policy.iid_rule or not names <= set(distinct):
            raise ValueError(
                f"resispec_auto's policy names iid {self.policy.iid_rule!r} and distinct {sorted(names)}; "
                f"given iid {iid.name!r} and distinct {sorted(distinct)}"
            )
        self.iid, self.distinct = iid, dict(distinct)

    def __repr__(self) -> str:
        return f"<verification rule {self.name!r} ({self.policy})>"

    @property
    def one_draw_is_standard(self) -> bool:
        """At one draw every row takes the i.i.d. branch (AutoPolicy.distinct_rows), so the rule's one-draw step is
        the i.i.d. rule's: the batched decoder walks such chains like resispec's (lean.walk_one_draw_chains)."""
        return bool(getattr(self.iid, "one_draw_is_standard", False))

    def _branches(self, n: int) -> tuple[VerificationRule, VerificationRule]:
        return self.iid, self.distinct[self.policy.distinct_rule_for(n)]

    @property
    def closed_form_draws(self) -> int | None:
        """The largest N such that every n <= N has a closed form on both branches (None: every n)."""
        caps = [self.iid.closed_form_draws, self.distinct[self.policy.distinct_rule].closed_form_draws]
        finite = [c for c in caps if c is not None]
        limit = min(finite) if finite else None
        for n, name in sorted(self.policy.distinct_rules.items()):  # per-n overrides can only lower it here
            if limit is not None and n > limit:
                break
            if not covers(self.distinct[name].closed_form_draws, n):
                limit = n - 1
                break
        return limit

    @property
    def surrogate_draws(self) -> int | None:
        """The surrogate is the i.i.d. branch's closed form where the distinct one has none."""
        return self.iid.closed_form_draws

    def propose(self, q: Tensor, n: int, generator: torch.Generator | None = None) -> Proposal:
        """q [B, V] -> AutoProposal(token_ids [B, n]); each row drafted by the branch its q selects. One draw: the
        i.i.d. rule's own proposal (no row is distinct at n = 1: AutoPolicy.distinct_rows), the same draws from
        the same generator, without the two-branch bookkeeping (a host sync per node where a chain's levels are
        selected and joined)."""
        check_draws(n)
        if n == 1:
            return self.iid.propose(q, 1, generator)
        iid, distinct = self._branches(n)
        mask = self.policy.distinct_rows(q, n)  # [B]
        d_rows, i_rows = mask.nonzero()[:, 0], (~mask).nonzero()[:, 0]
        tokens = torch.full((q.shape[0], n), -1, dtype=torch.long, device=q.device)
        noise = None
        d_part = distinct.propose(q[d_rows], n, generator) if len(d_rows) else None
        i_part = iid.propose(q[i_rows], n, generator) if len(i_rows) else None
        if d_part is not None:
            tokens[d_rows] = d_part.token_ids
            # for callers that read proposal.noise; rows of the other branch are 0
            if d_part.noise is not None:
                noise = torch.zeros_like(q)
                noise[d_rows] = d_part.noise
        if i_part is not None:
            tokens[i_rows] = i_part.token_ids
        return AutoProposal(
            token_ids=tokens, q=q, noise=noise, distinct_mask=mask, iid_part=i_part, distinct_part=d_part
        )

    def verify(self, p: Tensor, proposal: Proposal, generator: torch.Generator | None = None):
        """p [B, V] -> token [B], slot [B]; each row verified by the rule that drafted it."""
        check_pair(p, proposal.q)
        if not isinstance(proposal, AutoProposal) and proposal.num_draws == 1:  # propose's one-draw proposal
            return self.iid.verify(p, proposal, generator)
        if not isinstance(proposal, AutoProposal) or proposal.distinct_mask is None:
            raise ValueError("resispec_auto.verify needs the AutoProposal made by resispec_auto.propose")
        iid, distinct = self._branches(proposal.num_draws)
        mask = proposal.distinct_mask
        token = torch.full((p.shape[0],), -1, dtype=torch.long, device=p.device)
        slot = torch.full_like(token, -1)
        for rule, part, rows in (
            (distinct, proposal.distinct_part, mask.nonzero()[:, 0]),
            (iid, proposal.iid_part, (~mask).nonzero()[:, 0]),
        ):
            if len(rows):
                t, s = rule.verify(p[rows], part, generator)
                token[rows], slot[rows] = t, s
        return token, slot

    def acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        """[B]: the chosen branch's closed form, exact on every row. Raises NotImplementedError when a row is on a
        distinct branch without one (gumbel, rsd; resispec_wor with n > 2): use `surrogate_acceptance` there."""
        return self._acceptance(p, q, n, strict=True)

    def surrogate_acceptance(self, p: Tensor, q: Tensor, n: int) -> Tensor:
        """[B]: like `acceptance`, but rows on a distinct branch without a closed form get the i.i.d. branch's
        closed form (what the node would accept had it drafted i.i.d.; module docstring). For training losses."""
        return self._acceptance(p, q, n, strict=False)

    def _acceptance(self, p: Tensor, q: Tensor, n: int, strict: bool) -> Tensor:
        check_pair(p, q)
        iid, distinct = self._branches(check_draws(n))
        alpha = iid.acceptance(p, q, n)
        mask = self.policy.distinct_rows(q, n)
        if bool(mask.any()):
            if covers(distinct.closed_form_draws, n):
                alpha = torch.where(mask, distinct.acceptance(p, q, n), alpha)
            elif strict:
                raise NotImplementedError(
                    f"resispec_auto: {int(mask.sum())} row(s) use {distinct.name!r}, which has no "
                    "closed-form acceptance; estimate it by sampling verify(), or use surrogate_acceptance"
                )
        return alpha

    def closed_form_rows(self, q: Tensor, n: int) -> Tensor:
        """Bool [B]: the rows of q [B, V] whose acceptance at n draws has a closed form (the i.i.d. branch's, and
        the distinct branch's where that rule has one at n); the others need sampling (verify/estimate.py)."""
        iid, distinct = self._branches(check_draws(n))
        mask = self.policy.distinct_rows(q, n)
        iid_rows = ~mask if covers(iid.closed_form_draws, n) else torch.zeros_like(mask)
        return iid_rows | mask if covers(distinct.closed_form_draws, n) else iid_rows

    def branch_names(self, q: Tensor, n: int) -> list[str]:
        """The rule each row of q [B, V] would use (for reports)."""
        mask = self.policy.distinct_rows(q, n)
        return [self.policy.distinct_rule_for(n) if m else self.policy.iid_rule for m in mask.tolist()]


def resolve_auto_policy(value: AutoPolicy | str | Mapping | None) -> AutoPolicy | None:
    """`decode.auto_policy` -> AutoPolicy: None (the default policy), a JSON path (as the headroom tool writes),
    or inline values (a mapping of AutoPolicy fields)."""
    if value is None or isinstance(value, AutoPolicy):
        return value
    if isinstance(value, str):
        return AutoPolicy.load(value)
    if isinstance(value, Mapping):
        return AutoPolicy(**dict(value))
    raise ValueError(f"auto_policy must be a JSON path or a mapping of AutoPolicy fields, got {value!r}")
