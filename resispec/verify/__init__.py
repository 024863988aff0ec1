"""Exact multi-candidate verification rules and their closed-form acceptance (DESIGN.md "Verification rules").

    from resispec.verify import VERIFIERS, optimal_acceptance
    rule = VERIFIERS["resispec"]
    proposal = rule.propose(q, n, generator)             # q [B, V] -> proposal.token_ids [B, n] in draw order
    token, slot = rule.verify(p, proposal, generator)    # [B], [B] (slot -1: no draw accepted)
    alpha = rule.acceptance(p, q, n)                     # [B], differentiable (training losses)
    optimal_acceptance(p, q, n, scheme="iid")            # [B] upper bound (scheme="wor": small V only)

Every rule has `name` and `scheme` ("iid" | "distinct" | "deterministic"). Conventions (empty slots = -1,
slot = first draw of the emitted token) are in `resispec.verify.base`. Add a rule with `register(rule)`.
"""

from __future__ import annotations

from resispec.verify.base import SCHEMES, Proposal, VerificationRule
from resispec.verify.bounds import optimal_acceptance
from resispec.verify.distinct import GumbelRule, HubRule, OneHotRule, RsdRule
from resispec.verify.iid import (
    ChainRule,
    KseqRule,
    ResiSpecRule,
    RrsRule,
    capped_mass,
    solve_kseq_rho,
    solve_resispec_T,
)

VERIFIERS: dict[str, VerificationRule] = {}


def register(rule: VerificationRule) -> VerificationRule:
    """Add `rule` to VERIFIERS under rule.name (checks the Protocol; a name can be registered once)."""
    if not isinstance(rule, VerificationRule) or getattr(rule, "scheme", None) not in SCHEMES:
        raise ValueError(f"{rule!r} is not a VerificationRule with scheme in {SCHEMES}")
    if rule.name in VERIFIERS and VERIFIERS[rule.name] is not rule:
        raise ValueError(f"a verification rule named {rule.name!r} is already registered")
    VERIFIERS[rule.name] = rule
    return rule


for _rule in (
    ChainRule(),
    OneHotRule(),
    RrsRule(),
    RsdRule(),
    KseqRule(),
    HubRule(),
    GumbelRule(),
    ResiSpecRule(),
):
    register(_rule)

__all__ = [
    "VERIFIERS",
    "Proposal",
    "VerificationRule",
    "capped_mass",
    "optimal_acceptance",
    "register",
    "solve_kseq_rho",
    "solve_resispec_T",
]

# resispec_auto (per-node choice of drafting scheme) and resispec_wor (shaping for distinct draws) register
# themselves; imported last because they build on the rules above.
from resispec.verify import auto as _auto  # noqa: E402, F401
