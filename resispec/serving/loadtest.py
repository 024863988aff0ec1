"""Load-test a running resispec (or any OpenAI-compatible) server: N concurrent streaming clients, a bounded number
of requests, p50/p95 latency, time to first token and tokens/s. Localhost only: this is a benchmark of your own
server, not a traffic generator.

  run_load_test(url, prompts, bench)     one concurrency level (bench.concurrency)
  run_load_sweep(url, prompts, bench)    every level of bench.concurrencies: table, JSON and plot
  run_interleaved({label: url}, ...)     several servers in one run, every level on each in turn (ABBA over
                                         bench.rounds): the same table and plot, with their throughput ratios
  python -m resispec.serving.loadtest [Hydra overrides of the bench config, e.g. bench.max_new_tokens=32]
                                         in-process: the one-at-a-time server (AR, speculative) and continuous
                                         batching (AR, speculative, adaptive) on the same requests, swept, one report
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

import httpx

from resispec.errors import UserError, exit_on_user_error
from resispec.serving.config import BenchConfig

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


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


class LoadTestError(UserError, ValueError):
    """The load test cannot run as asked: a server list that does not parse, a server that is not on this machine
    or does not answer, a level below 1."""


def check_local(url: str) -> None:
    """Refuse anything but the local machine."""
    host = urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise LoadTestError(
            f"the load test's server URL must point at this machine ({', '.join(LOCAL_HOSTS)}), got {host!r}"
        )


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _scrape(text: str) -> dict[str, float]:
    """A /metrics body -> {name: value} of resispec's metrics, summed over their labels except `mode` (a metric with
    a mode label is keyed "name:mode")."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("resispec:"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        mode = re.search(r'mode="([^"]*)"', labels)
        key = f"{name}:{mode.group(1)}" if mode else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


STEP_MODES = ("draft", "ar")


def _step_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, list[float]]:
    """The batch steps between two scrapes: mode -> [steps, seconds, tokens] (empty for a server without them)."""
    names = (
        "resispec:batch_steps_total",
        "resispec:batch_step_seconds_total",
        "resispec:batch_step_tokens_total",
    )
    out = {}
    for mode in STEP_MODES:
        delta = [after.get(f"{n}:{mode}", 0.0) - before.get(f"{n}:{mode}", 0.0) for n in names]
        if delta[0] > 0:
            out[mode] = delta
    return out


def request_max_tokens(bench: BenchConfig, i: int) -> int:
    """max_tokens of the load test's request i: bench.max_new_tokens, or with bench.output_len_range_ratio = r a
    length drawn uniformly from [L (1 - r), L (1 + r)] (vLLM's --random-range-ratio), the same for request i on
    every server (seeded by bench.seed + i)."""
    r, n = bench.output_len_range_ratio, bench.max_new_tokens
    if not r:
        return n
    return max(1, round(n * (1 - r + 2 * r * random.Random(bench.seed + i).random())))


async def _one(
    client: httpx.AsyncClient,
    model: str,
    prompt: str,
    bench: BenchConfig,
    temperature: float,
    seed: int,
    max_tokens: int | None = None,
) -> tuple[float, float, int, list[float]]:
    """One streamed completion (max_tokens: bench.max_new_tokens unless given) -> (latency, ttft, completion
    tokens, the seconds between its chunks of text)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": bench.max_new_tokens if max_tokens is None else max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if bench.seeded_requests:
        body["seed"] = seed
    if bench.ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    ttft, tokens, last, gaps = None, 0, None, []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"].get("message"))
            if any(c.get("text") for c in event.get("choices", [])):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    latency = time.perf_counter() - t0
    return latency, latency if ttft is None else ttft, tokens, gaps


async def _load_test(
    url: str,
    prompts: list[str],
    bench: BenchConfig,
    api_key: str | None,
    model: str | None,
    concurrency: int,
    num_requests: int,
) -> LoadTestResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        metrics_before = (await client.get("/metrics")).text
        temperature = bench.temperatures[0] if bench.temperatures else 1.0
        sem = asyncio.Semaphore(concurrency)
        results: list[tuple] = []  # latency, ttft, tokens, gaps between chunks, max_tokens asked
        failures: list[str] = []

        async def worker(i: int) -> None:
            async with sem:
                try:
                    asked = request_max_tokens(bench, i)
                    prompt = prompts[i % len(prompts)]
                    out = await _one(client, model, prompt, bench, temperature, bench.seed + i, asked)
                    results.append((*out, asked))
                except Exception as exc:  # counted, reported; the test goes on
                    failures.append(str(exc))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(num_requests)))
        wall = time.perf_counter() - t0
        before, after = _scrape(metrics_before), _scrape((await client.get("/metrics")).text)
    drafts, accepted = (
        after.get(name, 0.0) - before.get(name, 0.0)
        for name in (
            "resispec:spec_decode_num_drafts_total",
            "resispec:spec_decode_num_accepted_tokens_total",
        )
    )
    latencies = [r[0] for r in results]
    ttfts = [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    gaps = [g for r in results for g in r[3]]
    return LoadTestResult(
        url=url,
        model=model,
        concurrency=concurrency,
        num_requests=num_requests,
        num_ok=len(results),
        num_failed=len(failures),
        temperature=temperature,
        max_tokens=bench.max_new_tokens,
        wall_seconds=wall,
        completion_tokens=tokens,
        tokens_per_second=tokens / wall if wall > 0 else 0.0,
        requests_per_second=len(results) / wall if wall > 0 else 0.0,
        latency_p50=percentile(latencies, 50),
        latency_p95=percentile(latencies, 95),
        ttft_p50=percentile(ttfts, 50),
        ttft_p95=percentile(ttfts, 95),
        server_tau=1 + accepted / drafts if drafts > 0 else None,
        num_short=sum(r[2] < r[4] for r in results) if bench.ignore_eos else 0,
        steps=_step_counts(before, after),
        itl_p50=percentile(gaps, 50) if gaps else None,
        itl_p99=percentile(gaps, 99) if gaps else None,
    )


def _check(url: str, prompts: list[str], bench: BenchConfig) -> None:
    check_local(url)
    if not prompts:
        raise LoadTestError("the load test needs at least one prompt")
    if bench.num_requests < 1 or bench.concurrency < 1 or any(c < 1 for c in bench.concurrencies):
        raise LoadTestError("bench.num_requests and the concurrency levels must be >= 1")


def _check_answers(label: str, url: str, api_key: str | None) -> None:
    """The server lists its models, before a sweep that would fail on its first request (a wrong port, a server
    still starting, a missing API key)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise LoadTestError(f"server {label!r} at {url} does not answer: {exc}") from None
    if r.status_code == 401:
        raise LoadTestError(
            f"server {label!r} at {url} refuses the API key (set RESISPEC_API_KEY or server.api_key)"
        )
    if r.status_code != 200:
        raise LoadTestError(f"server {label!r} at {url}: GET /v1/models gave HTTP {r.status_code}")


def run_load_test(
    url: str,
    prompts: list[str],
    bench: BenchConfig,
    api_key: str | None = None,
    model: str | None = None,
    output_dir: str | Path | None = None,
    show: bool = True,
) -> LoadTestResult:
    """Load-test the server at `url` (localhost only) at bench.concurrency; report.md / report.json in output_dir."""
    _check(url, prompts, bench)
    res = asyncio.run(
        _load_test(url.rstrip("/"), prompts, bench, api_key, model, bench.concurrency, bench.num_requests)
    )
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in asdict(res).items()]
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(asdict(res), indent=2))
        md = ["# resispec load test", "", "| metric | value |", "|---|---|"] + [
            f"| {k} | {v} |" for k, v in rows
        ]
        (out / "report.md").write_text("\n".join(md) + "\n")
    if show:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"load test: {url}")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for k, v in rows:
            table.add_row(k, v)
        Console().print(table)
    return res


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


def parse_servers(server_url: str | None, server_urls: list[str]) -> dict[str, str]:
    """bench.server_url and bench.server_urls ("LABEL=URL" or a bare URL, labelled by its host:port) -> {label:
    url}, in the order given (the first is the report's base for the ratios); empty when neither is set."""
    entries = ([server_url] if server_url else []) + list(server_urls)
    servers: dict[str, str] = {}
    for entry in entries:
        label, sep, url = entry.partition("=")
        if not sep or "://" in label:  # a bare URL (the label part would be a scheme)
            label, url = "", entry
        url = url.strip()
        if not url.startswith(("http://", "https://")):
            raise LoadTestError(f"bench.server_urls: {entry!r} is not LABEL=URL or an http(s) URL")
        parsed = urlparse(url)
        label = label.strip() or (
            "server" if len(entries) == 1 else f"{parsed.hostname}:{parsed.port or parsed.scheme}"
        )
        if label in servers:
            raise LoadTestError(f"bench.server_urls: the label {label!r} is given twice; label each server")
        servers[label] = url
    return servers


def run_load_sweep(
    url: str, prompts: list[str], bench: BenchConfig, label: str = "server", **kwargs
) -> list[LoadTestResult]:
    """One server's sweep: one load test per level of bench.concurrencies (each max(num_requests, level) requests,
    the same prompts and seeds; bench.rounds rounds, merged). kwargs: run_interleaved's (api_key, model,
    output_dir for the sweep table, JSON and plot, show)."""
    return run_interleaved({label: url}, prompts, bench, **kwargs)


def run_interleaved(
    servers: dict[str, str],
    prompts: list[str],
    bench: BenchConfig,
    api_key: str | None = None,
    model: str | None = None,
    output_dir: str | Path | None = None,
    show: bool = True,
    title: str = "",
    progress: bool | None = None,
) -> list[LoadTestResult]:
    """Load-test several servers ({label: url}, localhost only) in one run: for each of bench.rounds rounds and each
    level of bench.concurrencies, every server in turn, the order reversed every other round (ABBA), so a machine
    whose speed drifts within minutes weighs on every server alike. Each (server, level) is merged over its rounds
    (merge_rounds). The report (output_dir: sweep.md / .json / .png) adds each server's throughput relative to the
    first one and its p95 latency relative to its own lone request (comparison_table). model: the model name sent
    to every server; None asks each server's /v1/models. progress: a bar over the tests (default: as `show`)."""
    from tqdm.auto import tqdm

    if not servers:
        raise LoadTestError("no server to load-test")
    for label, url in servers.items():
        _check(url, prompts, bench)
        _check_answers(label, url, api_key)
    labels, rounds = list(servers), max(1, bench.rounds)
    runs: dict[tuple[str, int], list[LoadTestResult]] = {}
    total = rounds * len(bench.concurrencies) * len(labels)
    bar_on = show if progress is None else progress
    with tqdm(total=total, desc="load sweep", unit="test", disable=not bar_on or total == 1) as bar:
        for r in range(rounds):
            for level in bench.concurrencies:
                for label in labels if r % 2 == 0 else labels[::-1]:
                    bar.set_postfix_str(f"{label}, {level} clients")
                    url = servers[label].rstrip("/")
                    res = asyncio.run(
                        _load_test(url, prompts, bench, api_key, model, level, max(bench.num_requests, level))
                    )
                    res.label = label
                    runs.setdefault((label, level), []).append(res)
                    bar.update()
    results = [merge_rounds(runs[(label, level)]) for label in labels for level in bench.concurrencies]
    if output_dir is not None:
        write_sweep_report(results, output_dir, title)
    if show:
        print(sweep_report_text(results))
    return results


SWEEP_COLUMNS = (
    ("label", "server", "{}"),
    ("concurrency", "clients", "{}"),
    ("num_ok", "ok", "{}"),
    ("num_failed", "failed", "{}"),
    ("num_short", "short", "{}"),
    ("tokens_per_second", "tok/s", "{:.1f}"),
    ("ttft_p50", "TTFT p50 s", "{:.3f}"),
    ("ttft_p95", "TTFT p95 s", "{:.3f}"),
    ("latency_p50", "e2e p50 s", "{:.3f}"),
    ("latency_p95", "e2e p95 s", "{:.3f}"),
    ("itl_p99", "ITL p99 s", "{:.3f}"),
    ("server_tau", "tau", "{:.2f}"),
    ("drafted_share", "drafted", "{:.0%}"),
    ("draft_ms_per_token", "ms/tok drafting", "{:.2f}"),
    ("ar_ms_per_token", "ms/tok AR", "{:.2f}"),
)


def sweep_table(results: list[LoadTestResult]) -> str:
    """A markdown table, one row per (server, concurrency)."""
    head = "| " + " | ".join(c[1] for c in SWEEP_COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(SWEEP_COLUMNS)]
    for r in results:
        cells = []
        for key, _, fmt in SWEEP_COLUMNS:
            v = getattr(r, key)
            cells.append("-" if v is None else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparison_table(results: list[LoadTestResult]) -> str:
    """What a sweep's goals are stated in, per level: each server's tokens/s over the first server's (several
    servers), and each server's p95 latency over its own lone request (its p50 at 1 client, where the sweep has
    that level). Empty when neither applies."""
    labels = list(dict.fromkeys(r.label for r in results))
    levels = list(dict.fromkeys(r.concurrency for r in results))
    by = {(r.label, r.concurrency): r for r in results}
    base = labels[0] if labels else ""
    others = labels[1:]
    lone = {lab: by[(lab, 1)].latency_p50 for lab in labels if (lab, 1) in by and by[(lab, 1)].num_ok}
    if not others and not lone:
        return ""

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if not a or not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"

    def get(label: str, level: int, key: str) -> float | None:
        return getattr(by.get((label, level)), key, None)

    head = [f"{lab} / {base} tok/s" for lab in others] + [f"{lab}: p95 / lone" for lab in lone]
    lines = ["| clients | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for level in levels:
        cells = [
            ratio(get(lab, level, "tokens_per_second"), get(base, level, "tokens_per_second"))
            for lab in others
        ]
        cells += [ratio(get(lab, level, "latency_p95"), lone[lab]) for lab in lone]
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    caption = (
        f"Throughput relative to {base}, and each server's e2e p95 latency over its lone request (its p50 at 1 "
        "client), per level"
        if others and lone
        else f"Throughput relative to {base}, per level"
        if others
        else "e2e p95 latency over a lone request (the p50 at 1 client), per level"
    )
    return caption + ":\n\n" + "\n".join(lines)


def sweep_report_text(results: list[LoadTestResult]) -> str:
    """The sweep table, then the comparison table where there is one."""
    comparison = comparison_table(results)
    return sweep_table(results) + ("\n\n" + comparison if comparison else "")


def write_sweep_report(results: list[LoadTestResult], output_dir: str | Path, title: str = "") -> Path:
    """sweep.md (table), sweep.json and sweep.png (throughput and p95 latency against clients, one line per
    server) in output_dir; returns the markdown path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    md = out / "sweep.md"
    md.write_text(f"# resispec load sweep{': ' + title if title else ''}\n\n{sweep_report_text(results)}\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r.label for r in results):
        rs = [r for r in results if r.label == label]
        xs = [r.concurrency for r in rs]
        axes[0].plot(xs, [r.tokens_per_second for r in rs], marker="o", label=label)
        axes[1].plot(xs, [r.latency_p95 for r in rs], marker="o", label=label)
    for ax, name in zip(axes, ("throughput (tokens/s)", "end-to-end latency p95 (s)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=120)
    plt.close(fig)
    return md


# ---------------------------------------------------------------------------- in-process comparison
def serving_modes(max_batch_size: int = 16) -> dict[str, dict]:
    """The servers the in-process sweep compares (ServerConfig overrides; `rule` overrides decode.rule): today's
    one-at-a-time server (batch 1; plain AR, and speculative per decode.rule), and continuous batching with plain
    AR steps, with drafting at every step, and with the adaptive per-step policy."""
    return {
        "one-at-a-time AR": dict(max_batch_size=1, rule="ar"),
        "one-at-a-time": dict(max_batch_size=1),
        "batched AR": dict(max_batch_size=max_batch_size, speculation="never"),
        "batched spec": dict(max_batch_size=max_batch_size, speculation="always"),
        "batched adaptive": dict(max_batch_size=max_batch_size, speculation="auto"),
    }


class UnknownModeError(UserError, ValueError):
    """bench.modes names a serving mode that does not exist."""


def select_modes(names: list[str], max_batch_size: int = 16) -> dict[str, dict]:
    """The serving modes named in `names` (bench.modes; empty: all of serving_modes), in serving_modes' order."""
    modes = serving_modes(max_batch_size)
    unknown = [n for n in names if n not in modes]
    if unknown:
        raise UnknownModeError(f"bench.modes: unknown serving mode(s) {unknown}; choose from {list(modes)}")
    return {k: v for k, v in modes.items() if not names or k in names}


def serve_in_thread(app, log_level: str = "warning", timeout: float = 30.0):
    """Serve `app` with uvicorn in a daemon thread on a free localhost port -> (base URL, uvicorn server, thread),
    once it accepts requests. Stop it with `server.should_exit = True` and `thread.join()`."""
    import socket
    import threading

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.perf_counter() + timeout
    while not server.started:
        if not thread.is_alive() or time.perf_counter() > deadline:
            server.should_exit = True
            raise RuntimeError("the uvicorn server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


def compare_in_process(
    target,
    draft,
    tokenizer,
    decode,
    prompts: list[str],
    bench: BenchConfig,
    modes: dict[str, dict] | None = None,
    max_model_len: int = 2048,
    output_dir: str | Path | None = None,
    show: bool = True,
) -> list[LoadTestResult]:
    """Serve the loaded pair once per mode (each a uvicorn in a thread on a free localhost port, all up together)
    and load each with the same requests, interleaved (run_interleaved: bench.rounds rounds of every concurrency
    level, every mode in turn at each level, ABBA order). One table and plot for all, each (mode, level) merged over
    its rounds."""
    from resispec.serving.app import create_app
    from resispec.serving.config import ServerConfig
    from resispec.serving.server import (
        AR_RULES,
        batch_buckets,
        build_engine,
        off_main_thread,
        planned_trees,
        serving_threads,
    )
    from resispec.serving.text import encode_text

    # as the real server: a core left to the event loop (and to this load generator)
    serving_threads(ServerConfig(), spare_core=True)
    plans = None
    if decode.planned and decode.rule not in AR_RULES:  # tree=auto: plan once, every mode serves that plan
        calibration = [encode_text(tokenizer, p) for p in prompts[: max(decode.plan_prompts, 1)]]
        sizes = batch_buckets(max(bench.concurrencies or [bench.concurrency]))
        plans = off_main_thread(planned_trees, target, draft, decode, calibration, sizes)
    servers: dict[str, tuple] = {}  # label -> (url, uvicorn server, thread, app)
    try:
        for label, overrides in (modes or select_modes(bench.modes)).items():
            overrides = dict(overrides)
            dec = replace(decode, rule=overrides.pop("rule", decode.rule))
            server = ServerConfig(model_name="resispec", log_level="warning", **overrides)
            engine = off_main_thread(build_engine, target, draft, tokenizer, dec, server, plans=plans)
            app = create_app(engine, tokenizer, server, dec, max_model_len=max_model_len)
            servers[label] = (*serve_in_thread(app), app)
        urls = {label: s[0] for label, s in servers.items()}
        results = run_interleaved(urls, prompts, bench, show=False, progress=show)
        costs = {label: s[3].state.server.worker.scheduler.cost_table() for label, s in servers.items()}
    finally:
        for _, uv, _, _ in servers.values():
            uv.should_exit = True
        for _, _, thread, _ in servers.values():
            thread.join(30)
    lines = [
        f"| {label} | {b} | {c['tree'] if c['spec'] is not None else '-'} | "
        + " | ".join("-" if c[m] is None else f"{1000 * c[m]:.2f}" for m in ("spec", "ar"))
        + f" | {'-' if c.get('ratio') is None else format(c['ratio'], '.2f')}"
        + f" | {'-' if c.get('drafted') is None else format(c['drafted'], '.0%')} |"
        for label, table in costs.items()
        for b, c in table.items()
    ]
    planned = (
        "planned trees by batch size (decode.tree=auto; none = the planner predicts no gain), "
        + "; ".join(
            f"{label} rows: " + ", ".join(f"{b}: {t or 'none'}" for b, t in plan.items())
            for label, plan in zip(("sampled", "greedy"), plans, strict=True)
        )
        if plans
        else f"tree {decode.tree} at every batch size"
    )
    cost_md = "\n".join(
        [
            "",
            f"Measured cost per emitted token (ms, median of recent steps) by batch size; {planned}:",
            "",
            "| server | batch size | tree drafted | drafting | autoregressive | model ratio (drafting / AR) "
            "| steps drafted |",
            "|---|---|---|---|---|---|---|",
            *lines,
        ]
    )
    if output_dir is not None:
        md = write_sweep_report(results, output_dir, title=f"rule {decode.rule}, tree {decode.tree}")
        md.write_text(md.read_text() + cost_md + "\n")
    if show:
        print(sweep_report_text(results) + "\n" + cost_md)
    return results


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    """python -m resispec.serving.loadtest [hydra overrides of the `bench` config]: the in-process comparison on
    the configured pair (world, target, draft, decode), held-out prompts; the report goes to bench.output_dir."""
    import sys

    from hydra import compose, initialize_config_dir

    from resispec.config import register_configs, to_typed
    from resispec.data.prompts import load_heldout_prompts
    from resispec.models import load_pair
    from resispec.serving.server import context_length, off_main_thread
    from resispec.serving.text import decode_ids

    register_configs()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="bench", overrides=sys.argv[1:] if argv is None else argv)
    c = to_typed(cfg)
    target, draft, tokenizer = off_main_thread(load_pair, c.target, c.draft, c.world)
    prompts = [
        decode_ids(tokenizer, p)
        for p in load_heldout_prompts(c.data, tokenizer, c.world, c.bench.num_prompts)
    ]
    out = c.bench.output_dir or "outputs/loadtest"
    compare_in_process(
        target,
        draft,
        tokenizer,
        c.decode,
        prompts,
        c.bench,
        max_model_len=context_length(target, draft, c.server),
        output_dir=out,
    )
    print(f"report: {out}/sweep.md, {out}/sweep.png")


if __name__ == "__main__":
    main()
