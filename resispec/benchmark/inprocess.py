"""Every serving mode in one process: the loaded pair served once per mode (uvicorn in a thread, on a free localhost
port, all up together) and loaded with the same requests, interleaved (`load.run_interleaved`), one report.

  serving_modes(max_batch_size)          the modes: one-at-a-time (AR, speculative), batched AR / spec / adaptive
  compare_in_process(target, draft, ...) the comparison; `python bench/load.py` runs it on the configured pair
  serve_in_thread(app)                   one app on a free port in a daemon thread (tests use it too)
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import uvicorn

from resispec.benchmark.config import BenchConfig
from resispec.benchmark.load import run_interleaved
from resispec.benchmark.report import sweep_report_text, write_sweep_report
from resispec.benchmark.results import LoadTestResult
from resispec.errors import UserError
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
    cost_md = cost_markdown(costs, plans, decode)
    if output_dir is not None:
        md = write_sweep_report(results, output_dir, title=f"rule {decode.rule}, tree {decode.tree}")
        md.write_text(md.read_text() + cost_md + "\n")
    if show:
        print(sweep_report_text(results) + "\n" + cost_md)
    return results


def cost_markdown(costs: dict[str, dict], plans, decode) -> str:
    """The servers' measured cost per emitted token by batch size (Scheduler.cost_table of each mode), and the
    planned trees (decode.tree=auto) or the one configured tree, as markdown."""
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
    return cost_md
