"""What the benchmark measures, as data: a speed row (`BenchRow`), one method being timed (`Method`), a load test's
result (`LoadTestResult`) and how rounds of one merge (`merge_rounds`), the nearest-rank `percentile`, and the sum of
decoder counters over prompts (`sum_stats`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from resispec.decoding import DecodeStats


@dataclass
class BenchRow:
    """One measured method at one temperature."""

    method: str  # ar | spec | hf_assisted
    temperature: float
    draft: str = "-"  # draft label ("-" for AR)
    rule: str = "-"  # verification rule (spec rows)
    tree: str = "-"  # branching per depth, e.g. "[4,2,1,1]"; HF rows: "chain k"
    num_prompts: int = 0
    num_tokens: int = 0  # generated tokens, all prompts
    seconds: float = 0.0  # wall-clock, all prompts
    tokens_per_second: float = 0.0
    tau: float | None = None  # tokens per target verify forward (bonus included); AR = 1
    tau_stderr: float | None = None  # its standard error over the row's steps
    per_depth_acceptance: list[float] | None = None
    c: float | None = None  # draft forward time / target forward time
    speedup: float | None = None  # tokens/s over the AR row of the same temperature
    stats: dict[str, Any] = field(default_factory=dict)  # summed decoder counters

    @property
    def label(self) -> str:
        if self.method == "ar":
            return "AR"
        if self.method == "ar_ref":
            return "AR (HF forward)"
        if self.method == "hf_assisted":
            return f"HF assisted {self.tree} ({self.draft})"
        return f"{self.rule} {self.tree} ({self.draft})"


@dataclass
class Method:
    """One method to time: `run(prompt_ids, seed, max_new_tokens) -> (new tokens, DecodeStats | None)`."""

    row: BenchRow
    run: Any
    seconds: float = 0.0
    tokens: int = 0
    stats: list = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)  # per round of the bench (bench.rounds)
    round_tokens: list[int] = field(default_factory=list)


def tree_str(tree: list[int]) -> str:
    return "[" + ",".join(str(b) for b in tree) + "]"


def tree_of(row_tree: str) -> list[int]:
    """tree_str's inverse for a fixed or planned row's tree ("[1,1,1,1]" or "auto[2,1,1]")."""
    return [int(b) for b in row_tree.removeprefix("auto").strip("[]").split(",")]


def sum_stats(stats_list: list) -> Any:
    """Sum DecodeStats counters over prompts (list fields element-wise); properties then give tau, c, ..."""

    total = DecodeStats()
    for s in stats_list:
        for f in fields(DecodeStats):
            a, b = getattr(total, f.name), getattr(s, f.name)
            if isinstance(b, list):
                n = max(len(a), len(b))
                a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
                setattr(total, f.name, [x + y for x, y in zip(a, b, strict=True)])
            else:
                setattr(total, f.name, a + b)
    return total


@dataclass
class LoadTestResult:
    url: str
    model: str
    concurrency: int
    num_requests: int
    num_ok: int
    num_failed: int
    temperature: float
    max_tokens: int
    wall_seconds: float
    completion_tokens: int
    tokens_per_second: float  # all completion tokens / wall-clock of the whole test
    requests_per_second: float
    latency_p50: float
    latency_p95: float
    ttft_p50: float
    ttft_p95: float
    server_tau: float | None  # 1 + accepted / drafts from the server's /metrics, this test only
    num_short: int = 0  # completed with fewer tokens than max_tokens although ignore_eos was sent
    label: str = ""
    # the server's batch decode steps in this test, from /metrics: mode ("draft" | "ar") -> [steps, s, tokens]
    steps: dict[str, list[float]] = field(default_factory=dict)
    # inter-chunk latency: seconds between two streamed chunks of a request (a chunk holds one decode step's
    # tokens), over every request of the test; a stall of the running streams (a long prefill) shows here first
    itl_p50: float | None = None
    itl_p99: float | None = None

    @property
    def drafted_share(self) -> float | None:
        """The share of the server's batch steps in which the rows drafted (None: no batch steps counted)."""
        total = sum(c[0] for c in self.steps.values())
        return self.steps.get("draft", [0.0])[0] / total if total else None

    def ms_per_token(self, mode: str) -> float | None:
        """Milliseconds per emitted token of the server's `mode` steps in this test."""
        _, seconds, tokens = self.steps.get(mode, (0, 0.0, 0))
        return 1e3 * seconds / tokens if tokens else None

    @property
    def draft_ms_per_token(self) -> float | None:
        return self.ms_per_token("draft")

    @property
    def ar_ms_per_token(self) -> float | None:
        return self.ms_per_token("ar")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


STEP_MODES = ("draft", "ar")


def merge_rounds(runs: list[LoadTestResult]) -> LoadTestResult:
    """One result for several rounds of the same (server, level): counts and seconds summed, tokens/s and
    requests/s over the summed wall-clock, latency percentiles and tau the mean of the rounds'."""
    if len(runs) == 1:
        return runs[0]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    taus = [r.server_tau for r in runs if r.server_tau is not None]
    itl = {q: [getattr(r, q) for r in runs if getattr(r, q) is not None] for q in ("itl_p50", "itl_p99")}
    wall = sum(r.wall_seconds for r in runs)
    tokens = sum(r.completion_tokens for r in runs)
    ok = sum(r.num_ok for r in runs)
    return replace(
        runs[0],
        num_requests=sum(r.num_requests for r in runs),
        num_ok=ok,
        num_failed=sum(r.num_failed for r in runs),
        wall_seconds=wall,
        completion_tokens=tokens,
        tokens_per_second=tokens / wall if wall > 0 else 0.0,
        requests_per_second=ok / wall if wall > 0 else 0.0,
        latency_p50=mean([r.latency_p50 for r in runs]),
        latency_p95=mean([r.latency_p95 for r in runs]),
        ttft_p50=mean([r.ttft_p50 for r in runs]),
        ttft_p95=mean([r.ttft_p95 for r in runs]),
        server_tau=mean(taus) if taus else None,
        itl_p50=mean(itl["itl_p50"]) if itl["itl_p50"] else None,
        itl_p99=mean(itl["itl_p99"]) if itl["itl_p99"] else None,
        num_short=sum(r.num_short for r in runs),
        steps={
            mode: [sum(r.steps[mode][i] for r in runs if mode in r.steps) for i in range(3)]
            for mode in STEP_MODES
            if any(mode in r.steps for r in runs)
        },
    )
