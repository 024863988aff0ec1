"""Typed config for speculative decoding (Hydra group `decode`). Training reads `rule` and `tree` too, so
the residual loss targets the rule and candidate count used at serving time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecodeConfig:
    rule: str = "resispec"  # a key of resispec.verify.VERIFIERS
    # resispec_auto's policy: a JSON path (serve/headroom.py writes auto_policy.json) or inline AutoPolicy fields,
    # e.g. decode.auto_policy={threshold: 0.2, distinct_rule: rsd}; null = the default policy
    auto_policy: Any = None
    tree: list[int] = field(default_factory=lambda: [4, 2, 1, 1])  # branching per depth; [1]*k is a chain
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    compile: bool = False  # torch.compile the per-step functions (GPU)
