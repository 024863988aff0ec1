"""Decoding statistics: the quantities docs/design.md asks for (tau, per-depth acceptance, c) and vLLM's spec-decode
counters (num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_position)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class DecodeStats:
    """Counters of one `generate` call. Timings are wall-clock seconds (CUDA-synchronised when timing is on)."""

    target_forwards: int = 0  # all target forwards, prefill included
    draft_forwards: int = 0  # all draft forwards (the draft's prefill is folded into its first step)
    num_drafts: int = 0  # speculative steps = verify forwards (one tree each)
    num_draft_tokens: int = 0  # tree nodes proposed, summed over steps (repeated draws merged)
    num_accepted_tokens: int = 0  # accepted draft tokens (the bonus/correction token is not counted)
    accepted_sq: int = 0  # sum over steps of (accepted draft tokens)^2: tau's standard error
    accepted_per_position: list[int] = field(default_factory=list)  # [D] accepted at depth d+1
    reached_per_position: list[int] = field(default_factory=list)  # [D] steps whose walk reached depth d+1
    num_new_tokens: int = 0  # tokens emitted (after stop truncation)
    draft_seconds: float = 0.0
    draft_forward_seconds: float = (
        0.0  # of draft_seconds: the draft model's forwards alone (CPU; launch time on CUDA)
    )
    target_seconds: float = 0.0
    accept_seconds: float = 0.0  # the rule's verification walk (host side), apart from the forwards
    total_seconds: float = 0.0
    # prompt tokens whose K/V came from the prefix cache (the target's), not a forward
    cached_prompt_tokens: int = 0

    def record_step(self, num_nodes: int, num_accepted: int, depth: int) -> None:
        """Count one speculative step: a tree of `num_nodes` nodes (root included) and `depth` levels whose walk
        accepted `num_accepted` draft tokens (it reached depth d+1 for d <= num_accepted)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_nodes - 1
        self.num_accepted_tokens += num_accepted
        self.accepted_sq += num_accepted * num_accepted
        for per_position in (self.reached_per_position, self.accepted_per_position):
            per_position.extend([0] * (depth - len(per_position)))  # a deeper tree than the earlier steps'
        for j in range(min(num_accepted + 1, depth)):
            self.reached_per_position[j] += 1
            self.accepted_per_position[j] += int(j < num_accepted)

    @property
    def tau(self) -> float:
        """Accepted length: tokens per verify forward, bonus/correction included (1.0 = no gain; AR = 1.0)."""
        if self.num_drafts == 0:
            return 1.0
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts

    @property
    def tau_stderr(self) -> float | None:
        """Standard error of tau over its steps (steps taken as independent); None below two steps or without
        the per-step squares (vLLM's counters)."""
        n = self.num_drafts
        if n < 2 or (self.accepted_sq == 0 and self.num_accepted_tokens > 0):
            return None
        mean = self.num_accepted_tokens / n
        var = max(self.accepted_sq / n - mean * mean, 0.0) * n / (n - 1)
        return math.sqrt(var / n)

    @property
    def per_depth_acceptance(self) -> list[float]:
        """P(accept at depth d | the walk reached depth d), d = 1..D."""
        return [
            a / r if r else 0.0
            for a, r in zip(self.accepted_per_position, self.reached_per_position, strict=True)
        ]

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def c(self) -> float:
        """Draft forward time / target forward time (mean per forward)."""
        if not (self.draft_forwards and self.target_forwards and self.target_seconds > 0):
            return 0.0
        return (self.draft_seconds / self.draft_forwards) / (self.target_seconds / self.target_forwards)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(
            tau=self.tau,
            tau_stderr=self.tau_stderr,
            per_depth_acceptance=self.per_depth_acceptance,
            tokens_per_second=self.tokens_per_second,
            c=self.c,
        )
        return out
