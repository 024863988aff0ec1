"""The rule registry, built in one place from an explicit tuple (no import side effects, no environment).

    VERIFIERS["resispec"]                                   # the shared, default-configured rule objects
    build_rule("resispec_auto", "outputs/headroom/.../auto_policy.json")   # a rule with its own policy
    build_rule("resispec_auto", {"threshold": 0.2})         # inline AutoPolicy values (decode.auto_policy)

`resispec_auto` receives its branch rules from here (ResiSpecAutoRule(policy, iid=, distinct=)); a policy is data,
so each `build_rule` call with a policy returns a new, independent rule object.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from resispec.verify.auto import AutoPolicy, ResiSpecAutoRule, default_policy, resolve_auto_policy
from resispec.verify.base import SCHEMES, VerificationRule
from resispec.verify.distinct import GumbelRule, HubRule, OneHotRule, RsdRule
from resispec.verify.greedy import GreedyRule
from resispec.verify.iid import ChainRule, KseqRule, ResiSpecRule, RrsRule
from resispec.verify.wor import ResiSpecWORRule

# every rule but resispec_auto, which is assembled from these
BASE_RULES: tuple[VerificationRule, ...] = (
    ChainRule(),
    OneHotRule(),
    RrsRule(),
    RsdRule(),
    KseqRule(),
    HubRule(),
    GumbelRule(),
    ResiSpecRule(),
    ResiSpecWORRule(),
    GreedyRule(),
)


def check_rule(rule: object) -> VerificationRule:
    """`rule` must follow the VerificationRule Protocol (incl. its declared capabilities) with a known scheme."""
    if not isinstance(rule, VerificationRule) or getattr(rule, "scheme", None) not in SCHEMES:
        raise ValueError(f"{rule!r} is not a VerificationRule with scheme in {SCHEMES}")
    return rule


def auto_rule(
    policy: AutoPolicy | None = None, rules: Iterable[VerificationRule] = BASE_RULES
) -> ResiSpecAutoRule:
    """resispec_auto with `policy` (None = default), its branches taken from `rules` by name."""
    by_name = {r.name: r for r in rules}
    policy = policy or default_policy()
    if policy.iid_rule not in by_name:
        raise ValueError(f"unknown iid rule {policy.iid_rule!r} in the resispec_auto policy")
    distinct = {n: r for n, r in by_name.items() if r.scheme == "distinct"}
    return ResiSpecAutoRule(policy, iid=by_name[policy.iid_rule], distinct=distinct)


def build_registry(rules: Iterable[VerificationRule]) -> dict[str, VerificationRule]:
    """name -> rule, checking the Protocol and that each name appears once."""
    out: dict[str, VerificationRule] = {}
    for rule in rules:
        check_rule(rule)
        if rule.name in out:
            raise ValueError(f"a verification rule named {rule.name!r} is already registered")
        out[rule.name] = rule
    return out


VERIFIERS: dict[str, VerificationRule] = build_registry((*BASE_RULES, auto_rule()))


def register(rule: VerificationRule) -> VerificationRule:
    """Add a rule of your own to VERIFIERS under rule.name (an explicit call; a name can be registered once)."""
    check_rule(rule)
    if rule.name in VERIFIERS and VERIFIERS[rule.name] is not rule:
        raise ValueError(f"a verification rule named {rule.name!r} is already registered")
    VERIFIERS[rule.name] = rule
    return rule


def build_rule(name: str, auto_policy: AutoPolicy | str | Mapping | None = None) -> VerificationRule:
    """The rule a decoder should run for `decode.rule` / `decode.auto_policy`: VERIFIERS[name], except that
    resispec_auto with a policy (a JSON path, inline values or an AutoPolicy) is built fresh with it."""
    if name not in VERIFIERS:
        raise KeyError(f"unknown verification rule {name!r}; known: {sorted(VERIFIERS)}")
    policy = resolve_auto_policy(auto_policy)
    if name == "resispec_auto" and policy is not None:
        return auto_rule(policy)
    return VERIFIERS[name]
