"""Exact multi-candidate verification rules and their closed-form acceptance (docs/design.md "Verification rules").

    from resispec.verify import VERIFIERS, optimal_acceptance
    rule = VERIFIERS["resispec"]
    proposal = rule.propose(q, n, generator)             # q [B, V] -> proposal.token_ids [B, n] in draw order
    token, slot = rule.verify(p, proposal, generator)    # [B], [B] (slot -1: no draw accepted)
    alpha = rule.acceptance(p, q, n)                     # [B], differentiable (training losses)
    optimal_acceptance(p, q, n, scheme="iid")            # [B] upper bound (scheme="wor": small V only)

Every rule has `name`, `scheme` ("iid" | "distinct" | "deterministic") and declared capabilities
(`closed_form_draws`, `surrogate_draws`, `greedy_only`; resispec.verify.base). Conventions (empty slots = -1,
slot = first draw of the emitted token) are in `resispec.verify.base`. The registry is built explicitly in
`resispec.verify.registry`; `build_rule(name, auto_policy)` gives a resispec_auto with its own policy; add a rule of
your own with `register(rule)`.
"""

from __future__ import annotations

from resispec.verify.auto import AutoPolicy, ResiSpecAutoRule
from resispec.verify.base import SCHEMES, Proposal, VerificationRule, covers
from resispec.verify.bounds import optimal_acceptance
from resispec.verify.iid import capped_mass, solve_kseq_rho, solve_resispec_T
from resispec.verify.registry import VERIFIERS, build_rule, register

__all__ = [
    "SCHEMES",
    "VERIFIERS",
    "AutoPolicy",
    "Proposal",
    "ResiSpecAutoRule",
    "VerificationRule",
    "build_rule",
    "capped_mass",
    "covers",
    "optimal_acceptance",
    "register",
    "solve_kseq_rho",
    "solve_resispec_T",
]
