"""Load-test a running resispec (or any OpenAI-compatible) server: N concurrent streaming clients, a bounded number
of requests, p50/p95 latency, time to first token and tokens/s. Localhost only: this is a benchmark of your own
server, not a traffic generator."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx

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


def check_local(url: str) -> None:
    """Refuse anything but the local machine."""
    host = urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise ValueError(
            f"bench.server_url must point at this machine ({', '.join(LOCAL_HOSTS)}), got {host!r}"
        )


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _spec_counters(text: str) -> tuple[float, float]:
    drafts = accepted = 0.0
    for line in text.splitlines():
        if line.startswith("resispec:spec_decode_num_drafts_total"):
            drafts += float(line.rsplit(" ", 1)[1])
        elif line.startswith("resispec:spec_decode_num_accepted_tokens_total"):
            accepted += float(line.rsplit(" ", 1)[1])
    return drafts, accepted


async def _one(
    client: httpx.AsyncClient, model: str, prompt: str, bench: BenchConfig, temperature: float, seed: int
) -> tuple[float, float, int]:
    """One streamed completion -> (latency, ttft, completion tokens)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": bench.max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"].get("message"))
            if ttft is None and any(c.get("text") for c in event.get("choices", [])):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    latency = time.perf_counter() - t0
    return latency, latency if ttft is None else ttft, tokens


async def _load_test(
    url: str, prompts: list[str], bench: BenchConfig, api_key: str | None, model: str | None
) -> LoadTestResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=bench.concurrency + 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        metrics_before = (await client.get("/metrics")).text
        temperature = bench.temperatures[0] if bench.temperatures else 1.0
        sem = asyncio.Semaphore(bench.concurrency)
        results: list[tuple[float, float, int]] = []
        failures: list[str] = []

        async def worker(i: int) -> None:
            async with sem:
                try:
                    results.append(
                        await _one(
                            client, model, prompts[i % len(prompts)], bench, temperature, bench.seed + i
                        )
                    )
                except Exception as exc:  # counted, reported; the test goes on
                    failures.append(str(exc))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(bench.num_requests)))
        wall = time.perf_counter() - t0
        d0, a0 = _spec_counters(metrics_before)
        d1, a1 = _spec_counters((await client.get("/metrics")).text)
    latencies = [r[0] for r in results]
    ttfts = [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    return LoadTestResult(
        url=url,
        model=model,
        concurrency=bench.concurrency,
        num_requests=bench.num_requests,
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
        server_tau=1 + (a1 - a0) / (d1 - d0) if d1 > d0 else None,
    )


def run_load_test(
    url: str,
    prompts: list[str],
    bench: BenchConfig,
    api_key: str | None = None,
    model: str | None = None,
    output_dir: str | Path | None = None,
    show: bool = True,
) -> LoadTestResult:
    """Load-test the server at `url` (localhost only) and write report.md / report.json into output_dir."""
    check_local(url)
    if not prompts:
        raise ValueError("the load test needs at least one prompt")
    if bench.num_requests < 1 or bench.concurrency < 1:
        raise ValueError("bench.num_requests and bench.concurrency must be >= 1")
    res = asyncio.run(_load_test(url.rstrip("/"), prompts, bench, api_key, model))
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
