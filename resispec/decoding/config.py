"""Typed config for speculative decoding (Hydra group `decode`). Training reads `rule` and `tree` too, so
the residual loss targets the rule and candidate count used at serving time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from resispec.errors import UserError

AUTO_TREE = "auto"
DEFAULT_TREE = (4, 2, 1, 1)


@dataclass
class DecodeConfig:
    rule: str = "resispec"  # a key of resispec.verify.VERIFIERS
    # resispec_auto's policy: a JSON path (bench/headroom.py writes auto_policy.json) or inline AutoPolicy fields,
    # e.g. decode.auto_policy={threshold: 0.2, distinct_rule: rsd}; null = the default policy
    auto_policy: Any = None
    # branching per depth ([1]*k is a chain), or "auto": the tree planner (resispec/decoding/planner/) measures
    # this device and pair at start-up and picks the tree of most tokens per second (serving); training and
    # evaluation, which run before a trained draft exists to plan with, then use DEFAULT_TREE
    tree: Any = field(default_factory=lambda: list(DEFAULT_TREE))
    # tree=auto: held-out prompts (data eval split) for the planner: the first 4 calibrate acceptance and choose
    # the tree, the next 8 re-measure the choice, and at T = 0 every one counts tau (Planner)
    plan_prompts: int = 96
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    compile: bool = False  # torch.compile the per-step functions (GPU)
    # the decoder's own forward for Llama-family models (resispec/decoding/fast_forward.py); false = the HF forward
    fast_forward: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.tree, str):
            if self.tree != AUTO_TREE:
                raise UserError(
                    f"decode.tree must be a list of branchings like [4,2,1,1] or 'auto', got {self.tree!r}"
                )
        elif not self.tree or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.tree
        ):
            raise UserError(
                f"decode.tree must be a non-empty list of positive ints or 'auto', got {self.tree!r}"
            )
        else:
            self.tree = [int(b) for b in self.tree]

    @property
    def planned(self) -> bool:
        """True for decode.tree=auto (the planner chooses the served tree)."""
        return self.tree == AUTO_TREE

    @property
    def fixed_tree(self) -> list[int]:
        """The configured tree, or DEFAULT_TREE under tree=auto (what training and evaluation use)."""
        return list(DEFAULT_TREE) if self.planned else list(self.tree)
