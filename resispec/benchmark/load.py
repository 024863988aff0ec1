"""Load-test a running resispec (or any OpenAI-compatible) server: N concurrent streaming clients, a bounded number
of requests, p50/p95 latency, time to first token and tokens/s. Localhost only: this is a benchmark of your own
server, not a traffic generator.

  run_load_test(url, prompts, bench)     one concurrency level (bench.concurrency)
  run_load_sweep(url, prompts, bench)    every level of bench.concurrencies: table, JSON and plot
  run_interleaved({label: url}, ...)     several servers in one run, every level on each in turn (ABBA over
                                         bench.rounds): the same table and plot, with their throughput ratios

The commands: python bench/load.py --server URL ... (running servers), python bench/load.py (every serving mode in
one process: benchmark/inprocess.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlparse

import httpx
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from resispec.benchmark.config import BenchConfig
from resispec.benchmark.report import sweep_report_text, write_sweep_report
from resispec.benchmark.results import STEP_MODES, LoadTestResult, merge_rounds, percentile
from resispec.errors import UserError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


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


def scrape_metrics(text: str) -> dict[str, float]:
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


def step_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, list[float]]:
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


async def one_request(
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
                    out = await one_request(client, model, prompt, bench, temperature, bench.seed + i, asked)
                    results.append((*out, asked))
                except Exception as exc:  # counted, reported; the test goes on
                    failures.append(str(exc))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(num_requests)))
        wall = time.perf_counter() - t0
        before, after = scrape_metrics(metrics_before), scrape_metrics((await client.get("/metrics")).text)
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
        steps=step_counts(before, after),
        itl_p50=percentile(gaps, 50) if gaps else None,
        itl_p99=percentile(gaps, 99) if gaps else None,
    )


def check_load_args(url: str, prompts: list[str], bench: BenchConfig) -> None:
    check_local(url)
    if not prompts:
        raise LoadTestError("the load test needs at least one prompt")
    if bench.num_requests < 1 or bench.concurrency < 1 or any(c < 1 for c in bench.concurrencies):
        raise LoadTestError("bench.num_requests and the concurrency levels must be >= 1")


def check_answers(label: str, url: str, api_key: str | None) -> None:
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
    check_load_args(url, prompts, bench)
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
        table = Table(title=f"load test: {url}")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for k, v in rows:
            table.add_row(k, v)
        Console().print(table)
    return res


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
    if not servers:
        raise LoadTestError("no server to load-test")
    for label, url in servers.items():
        check_load_args(url, prompts, bench)
        check_answers(label, url, api_key)
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
