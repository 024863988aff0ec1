"""Prometheus metrics of the server, named after vLLM's (`vllm:` -> `resispec:`).

Spec-decode counters follow vLLM v1's definitions:
  num_drafts            speculative steps (one draft tree verified per step)
  num_draft_tokens      draft tokens proposed (tree nodes)
  num_accepted_tokens   draft tokens accepted (the bonus/correction token is not counted)
  num_accepted_tokens_per_pos{position=k}  steps whose draft token at depth k+1 was accepted
so mean accepted length tau = 1 + num_accepted_tokens / num_drafts.

The batch decode steps of continuous batching, by mode (`draft`: the rows drafted a tree; `ar`: a plain
autoregressive step) and batch-size bucket (`batch_size`: 1, 2, 4, 8, ..., the bucket's largest size), are counted
with their seconds and emitted tokens, so a client can read off where speculation ran and each mode's seconds per
token over any window (two scrapes):
  batch_steps{mode,batch_size}, batch_step_seconds{mode,batch_size}, batch_step_tokens{mode,batch_size}

The prefix cache counts as vLLM v1's does, in tokens: prefix_cache_queries (newcomers' prompt tokens looked up) and
prefix_cache_hits (those whose K/V was reused, not prefilled); hit rate = hits / queries.

Each app owns its registry, so several apps in one process (tests) never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets (seconds) as vLLM uses for its request histograms, cut to the range a CPU server sees.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
_ITL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)
_E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
)


class ServerMetrics:
    """All server metrics on one private registry; `render()` is the /metrics body."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["model_name"]
        self.model_name = model_name
        self.num_drafts = Counter(
            "resispec:spec_decode_num_drafts", "Speculative steps (verified draft trees).", lbl, registry=r
        )
        self.num_draft_tokens = Counter(
            "resispec:spec_decode_num_draft_tokens", "Draft tokens proposed.", lbl, registry=r
        )
        self.num_accepted_tokens = Counter(
            "resispec:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lbl, registry=r
        )
        self.accepted_per_pos = Counter(
            "resispec:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens at each draft position (0 = depth 1).",
            lbl + ["position"],
            registry=r,
        )
        self.prompt_tokens = Counter("resispec:prompt_tokens", "Prompt tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter("resispec:generation_tokens", "Tokens generated.", lbl, registry=r)
        self.request_success = Counter(
            "resispec:request_success",
            "Finished requests by finish reason.",
            lbl + ["finished_reason"],
            registry=r,
        )
        self.request_errors = Counter(
            "resispec:request_errors", "Requests whose generation failed (server errors).", lbl, registry=r
        )
        self.running = Gauge("resispec:num_requests_running", "Requests being decoded.", lbl, registry=r)
        self.waiting = Gauge(
            "resispec:num_requests_waiting", "Requests queued for the decoding worker.", lbl, registry=r
        )
        self.ttft = Histogram(
            "resispec:time_to_first_token_seconds",
            "Time to first token.",
            lbl,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "resispec:inter_token_latency_seconds",
            "Time between emitted tokens (a step emitting k tokens counts k times dt/k).",
            lbl,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "resispec:e2e_request_latency_seconds",
            "End-to-end request latency.",
            lbl,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self._add_step_and_cache_metrics(r, lbl)
        for gauge in (self.running, self.waiting):
            gauge.labels(model_name).set(0)
        for counter in (self.prefix_cache_queries, self.prefix_cache_hits):  # 0 until a prompt is looked up
            counter.labels(model_name)

    def _add_step_and_cache_metrics(self, r: CollectorRegistry, lbl: list[str]) -> None:
        """The batch-step counters (by mode and batch-size bucket) and the prefix cache's."""
        self.batch_steps = Counter(
            "resispec:batch_steps",
            "Batch decode steps, by mode (draft: the rows drafted a tree; ar: no row drafted) and batch-size bucket.",
            lbl + ["mode", "batch_size"],
            registry=r,
        )
        self.batch_step_seconds = Counter(
            "resispec:batch_step_seconds",
            "Seconds in batch decode steps, by mode and batch-size bucket.",
            lbl + ["mode", "batch_size"],
            registry=r,
        )
        self.batch_step_tokens = Counter(
            "resispec:batch_step_tokens",
            "Tokens emitted by batch decode steps, by mode and batch-size bucket.",
            lbl + ["mode", "batch_size"],
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "resispec:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (the target's; each prompt but its last token).",
            lbl,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "resispec:prefix_cache_hits",
            "Prompt tokens whose K/V the prefix cache held (not prefilled again).",
            lbl,
            registry=r,
        )

    def observe_spec(self, stats) -> None:
        """Add one request's DecodeStats to the spec-decode counters."""
        m = self.model_name
        self.num_drafts.labels(m).inc(stats.num_drafts)
        self.num_draft_tokens.labels(m).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(m).inc(stats.num_accepted_tokens)
        for pos, count in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(m, str(pos)).inc(count)

    def observe_prefix(self, queries: int, hits: int) -> None:
        """Newcomers' prompts looked up in the target's prefix cache: `queries` tokens, `hits` of them found."""
        self.prefix_cache_queries.labels(self.model_name).inc(queries)
        self.prefix_cache_hits.labels(self.model_name).inc(hits)

    def observe_step(self, mode: str, seconds: float, tokens: int, bucket: int = 1) -> None:
        """One batch decode step of `mode` ("draft" | "ar") at batch-size bucket `bucket` took `seconds` and emitted
        `tokens` tokens."""
        labels = (self.model_name, mode, str(bucket))
        self.batch_steps.labels(*labels).inc()
        self.batch_step_seconds.labels(*labels).inc(seconds)
        self.batch_step_tokens.labels(*labels).inc(tokens)

    def observe_chunk(self, dt: float, num_tokens: int) -> None:
        """A decode step emitted `num_tokens` tokens `dt` seconds after the previous one."""
        for _ in range(num_tokens):
            self.itl.labels(self.model_name).observe(dt / num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
