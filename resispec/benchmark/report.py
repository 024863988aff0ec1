"""The benchmark's reports: the speed table (markdown, terminal, speedup plot, report.md/json, W&B) and the load
sweep's table, comparison and plot (sweep.md/json/png)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from resispec.benchmark.results import BenchRow, LoadTestResult


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def table_rows(rows: list[BenchRow]) -> tuple[list[str], list[list[str]]]:
    header = [
        "T",
        "method",
        "draft",
        "rule",
        "tree",
        "tok/s",
        "tau",
        "±",
        "per-depth acceptance",
        "c",
        "speedup",
    ]
    body = []
    for r in rows:
        depth = "-" if not r.per_depth_acceptance else " ".join(f"{a:.2f}" for a in r.per_depth_acceptance)
        body.append(
            [
                f"{r.temperature:g}",
                r.method,
                r.draft,
                r.rule,
                r.tree,
                _fmt(r.tokens_per_second, 1),
                _fmt(r.tau),
                _fmt(r.tau_stderr),
                depth,
                _fmt(r.c, 3),
                _fmt(r.speedup),
            ]
        )
    return header, body


def best_lines(rows: list[BenchRow]) -> list[str]:
    """One line per temperature: the fastest speculative row and the best HF assisted row, vs AR."""
    lines = []
    for t in sorted({r.temperature for r in rows}):
        at = [r for r in rows if r.temperature == t and r.speedup is not None]
        parts = []
        for method, name in (("spec", "best speculative"), ("hf_assisted", "best HF assisted")):
            cands = [r for r in at if r.method == method]
            if cands:
                b = max(cands, key=lambda r: r.speedup)
                parts.append(f"{name}: {b.label} {b.speedup:.2f}x ({b.tokens_per_second:.1f} tok/s)")
        ar = next((r for r in at if r.method == "ar"), None)
        if ar is not None:
            parts.insert(0, f"AR {ar.tokens_per_second:.1f} tok/s")
        lines.append(f"- T={t:g}: " + "; ".join(parts))
    return lines


def markdown_table(rows: list[BenchRow]) -> str:
    header, body = table_rows(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def print_table(rows: list[BenchRow], title: str = "resispec bench") -> None:
    from rich.console import Console
    from rich.table import Table

    header, body = table_rows(rows)
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="left" if h in ("method", "draft", "rule", "tree") else "right")
    best = {}
    for r in rows:
        if r.speedup is not None and r.speedup > best.get(r.temperature, 0.0):
            best[r.temperature] = r.speedup
    for r, cells in zip(rows, body, strict=True):
        table.add_row(
            *cells, style="bold green" if r.speedup == best.get(r.temperature) and r.method != "ar" else None
        )
    Console(width=max(Console().width, 150)).print(table)  # a pipe gets 80 columns otherwise


def plot_speedup(rows: list[BenchRow], path: Path) -> None:
    """Horizontal bars: speedup of every non-AR method, one colour per temperature; a line at 1 (= AR)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r.temperature for r in rows})
    labels = list(dict.fromkeys(r.label for r in rows if r.method != "ar"))
    value = {(r.label, r.temperature): r.speedup or 0.0 for r in rows}
    height = 0.8 / max(len(temps), 1)
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.2 * len(labels) * max(len(temps), 1)))
    for j, t in enumerate(temps):
        ys = [i + j * height for i in range(len(labels))]
        ax.barh(ys, [value.get((lbl, t), 0.0) for lbl in labels], height=height, label=f"T={t:g}")
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_yticks([i + height * (len(temps) - 1) / 2 for i in range(len(labels))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup vs autoregressive (tokens/s ratio, same run)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(rows: list[BenchRow], output_dir: str | Path, meta: dict[str, Any]) -> dict[str, Path]:
    """report.md (table), report.json (rows + meta) and speedup.png into `output_dir`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "report.md", "json": out / "report.json", "png": out / "speedup.png"}
    lines = ["# resispec bench", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [
        "",
        "tok/s: generated tokens / wall-clock seconds over all prompts. tau: tokens per target verify "
        "forward (bonus included). ±: tau's standard error over the row's steps (each row is one seeded draw: "
        "rows whose tau differ by a few ± are not told apart). "
        "per-depth acceptance: P(accept at depth d | reached d). c: draft forward "
        "time / target forward time. speedup: tok/s / AR tok/s at the same temperature, same run.",
        "",
        markdown_table(rows),
        "",
    ]
    noise = round_noise(rows)
    if noise is not None:
        lines += [noise, ""]
    lines += breakdown_markdown(rows)
    paths["md"].write_text("\n".join(lines))
    payload = {"meta": meta, "rows": [{**asdict(r), "label": r.label} for r in rows]}
    paths["json"].write_text(json.dumps(payload, indent=2, default=str))
    plot_speedup(rows, paths["png"])
    return paths


def round_noise(rows: list[BenchRow]) -> str | None:
    """How far apart the bench's rounds put each row's speedup (max / min - 1 over its rounds, each round's own AR
    as the yardstick), as one line; None for a one-round run."""
    spreads = [
        max(sp) / min(sp) - 1
        for r in rows
        if r.method != "ar" and len(sp := r.stats.get("round_speedups") or []) > 1 and min(sp) > 0
    ]
    if not spreads:
        return None
    rounds = max(len(r.stats["round_speedups"]) for r in rows if r.stats.get("round_speedups"))
    median = statistics.median(spreads)
    return (
        f"Rounds: {rounds} interleaved rounds, each on its own prompts (the method order reversed every other "
        f"round); speedup above is over all of them. Between rounds a row's speedup moved by a median {median:.1%} "
        f"and at most {max(spreads):.1%} (max / min - 1): other prompts and the machine's noise, together."
    )


def fixed_rows_of(rows: list[BenchRow], planned: BenchRow) -> list[BenchRow]:
    """The fixed-tree rows of a tree=auto row's draft, rule and temperature (the trees it was chosen against)."""
    return [
        r
        for r in rows
        if r.method == "spec"
        and r.temperature == planned.temperature
        and r.draft == planned.draft
        and r.rule == planned.rule
        and r.speedup is not None
        and not r.tree.startswith(("auto", "ref"))
    ]


def breakdown_markdown(rows: list[BenchRow]) -> list[str]:
    """The per-step time breakdown of the speculative rows and the measured cost model, then the tree=auto table
    (plan_markdown), as markdown lines."""
    lines: list[str] = []
    costs = rows[0].stats.get("cost_model") if rows else None
    if costs:
        for label, c in costs.items():
            nodes = sorted(c["target_ms"])
            t1 = c["target_ms"][nodes[0]]
            lines += [
                f"Forward cost on this device (draft `{label}`): ms per forward over n new tokens after a 64-token "
                "cached prefix, and relative to one token.",
                "",
                "| n | " + " | ".join(str(n) for n in nodes) + " |",
                "|---|" + "---|" * len(nodes),
                "| target ms | " + " | ".join(f"{c['target_ms'][n]:.2f}" for n in nodes) + " |",
                "| target / 1 token | " + " | ".join(f"{c['target_ms'][n] / t1:.2f}" for n in nodes) + " |",
                "| draft ms | " + " | ".join(f"{c['draft_ms'][n]:.2f}" for n in nodes) + " |",
                "",
            ]
    spec = [r for r in rows if r.stats.get("breakdown")]
    if spec:
        lines += [
            "Per-step breakdown (ms per speculative step, measured inside the steps of this run): draft forwards, "
            "drafting (candidate sampling, tree masks), target forward, accept walk, other (cache compaction, "
            "bookkeeping); host overhead = step minus the two models' forwards, and as a fraction of one AR token's "
            "time in the same run and of the row's own target forward. predicted fwd: the cost model's forward time "
            "for that tree (measured at start-up, so on a drifting shared machine it can be off by tens of percent).",
            "",
            "| T | row | nodes | step | draft fwd | drafting | target fwd | accept | other | host overhead "
            "| overhead / AR token | overhead / target fwd | predicted fwd |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in spec:
            b = r.stats["breakdown"]
            pred = b.get("predicted_forward_ms")
            lines.append(
                f"| {r.temperature:g} | {r.label} | {b['mean_nodes']:.1f} | {b['step_ms']:.2f} "
                f"| {b['draft_forward_ms']:.2f} | {b['drafting_ms']:.2f} | {b['target_ms']:.2f} "
                f"| {b['accept_ms']:.2f} | {b['other_ms']:.2f} | {b['overhead_ms']:.2f} "
                f"| {b['overhead_frac_of_ar_token']:.0%} | {_pct(b.get('overhead_frac_of_target'))} | {_fmt(pred)} |"
            )
        lines.append("")
    return lines + plan_markdown(rows)


def plan_markdown(rows: list[BenchRow]) -> list[str]:
    """The tree=auto rows' table (predicted against measured, the best fixed row of the same rule, the candidates
    decoded, the planner's start-up) as markdown lines; none without planned rows."""
    lines: list[str] = []
    planned = [r for r in rows if r.stats.get("plan")]
    if planned:
        lines += [
            "tree=auto: the planner's choice, predicted against measured (same run). Predicted: the chosen tree and "
            "AR decoded again on fresh rounds of the planner's calibration prompts, after the near-tied candidates "
            "and the best chain were decoded to choose it; in brackets the product model's figure (none for a draft "
            "head) and the speedup it was chosen at (biased up: the winner of near-ties is the luckiest); start-up: "
            "the seconds the planner spent on the plan. A chain at T > 0 is predicted with the model's tau (its "
            "decoded tau beside it), its speedup scaled to it; at T = 0 every plan is, with its tau counted exactly "
            "on all the planner's prompts (the decoder's greedy step replayed along their greedy continuations). "
            "best fixed: the fastest fixed-tree row of the same "
            "draft and rule in this run, and the planned row's speedup over it (= where the planner chose that very "
            "tree: the two rows are the same decode, timed apart, so their ratio is the run's noise).",
            "",
            "| T | row | predicted tau | measured tau | predicted speedup | measured speedup | best fixed "
            "| planned / best fixed | candidates decoded | planner start-up |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in planned:
            pl = r.stats["plan"]
            model_tau, model_speedup = pl.get("tau_model"), pl.get("speedup_model")
            tau = f"{pl['tau']:.2f}" + (f" ({model_tau:.2f})" if model_tau is not None else "")
            if pl.get("tau_decoded") is not None:  # a chain at T > 0, any plan at T = 0 (planner/settle.py)
                tau = f"{pl['tau']:.2f} (model; decoded {pl['tau_decoded']:.2f})"
            notes = [f"{model_speedup:.2f}"] if model_speedup is not None else []
            if pl.get("selected_speedup") is not None:
                notes.append(f"chosen at {pl['selected_speedup']:.2f}")
            speedup = f"{pl['speedup']:.2f}" + (f" ({'; '.join(notes)})" if notes else "")
            decoded = ", ".join(f"{c['tree']} {c['speedup']:.2f}x" for c in pl.get("candidates", [])) or "-"
            best, vs_best = "-", "-"
            if (b := best_fixed_of(rows, r)) is not None:
                same = " (=)" if r.tree == f"auto{b.tree}" else ""
                best, vs_best = f"{b.tree} {b.speedup:.2f}", f"{r.speedup / b.speedup:.2f}{same}"
            lines.append(
                f"| {r.temperature:g} | {r.label} | {tau} | {_fmt(r.tau)} | {speedup} | {_fmt(r.speedup)} "
                f"| {best} | {vs_best} | {decoded} | {pl.get('startup_s', 0.0):.1f} s |"
            )
        init_s, greedy_s = rows[0].stats.get("planner_init_s"), rows[0].stats.get("planner_greedy_s")
        if init_s is not None:
            lines.append(f"\nPlanner start-up before any plan (the target's forward table): {init_s:.1f} s.")
        if greedy_s:
            lines.append(
                f"Planner start-up shared by the T = 0 plans, once (the target's greedy continuation of every planner "
                f"prompt, whose hits count tau): {greedy_s:.1f} s."
            )
        lines.append("")
    return lines + head_to_head_markdown(rows) + pool_markdown(rows)


def best_fixed_of(rows: list[BenchRow], planned: BenchRow) -> BenchRow | None:
    """The sweep's fastest fixed-tree row of a tree=auto row's draft, rule and temperature (None: no such row, or
    the planned row has no speedup)."""
    fixed = fixed_rows_of(rows, planned)
    return max(fixed, key=lambda x: x.speedup) if fixed and planned.speedup is not None else None


def head_to_head_markdown(rows: list[BenchRow]) -> list[str]:
    """The tree=auto head-to-head table (speed.confirm_plans: the planned and best fixed rows timed again after
    the sweep) as markdown lines; none where it did not run."""
    planned = [r for r in rows if r.stats.get("head_to_head") and r.stats.get("plan")]
    if not planned:
        return []
    h0 = planned[0].stats["head_to_head"]
    lines = [
        f"tree=auto head-to-head, after the sweep: AR, each planned row and the best fixed row of its rule (the "
        f"sweep's pick) timed again on the first round's {h0['prompts']} prompts, each prompt through all of them in "
        f"turn (the order reversed every other prompt and repeat), each call counted at its fastest of "
        f"{h0['repeats']}. The sweep's fastest row is also its luckiest; here it is measured afresh, beside the plan "
        "and AR. predicted / measured: the planner's predicted speedup over the head-to-head's. (=): the planner "
        "chose that very tree, one decode serves both.",
        "",
        "| T | row | predicted speedup | speedup, sweep | speedup, head-to-head | predicted / measured "
        "| best fixed, head-to-head | planned / best fixed, sweep | planned / best fixed, head-to-head |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in planned:
        h, pred = r.stats["head_to_head"], r.stats["plan"].get("speedup")
        b = best_fixed_of(rows, r)
        sweep = f"{r.speedup / b.speedup:.2f}" if b is not None else "-"
        best, vs = "-", "-"
        if h.get("best_fixed") is not None:
            best = f"{h['best_fixed']} {h['best_speedup']:.2f}"
            vs = f"{h['ratio']:.2f}" + (" (=)" if h["same_tree"] else "")
        miss = f"{pred / h['speedup'] - 1:+.1%}" if pred is not None else "-"
        lines.append(
            f"| {r.temperature:g} | {r.label} | {_fmt(pred)} | {_fmt(r.speedup)} | {h['speedup']:.2f} "
            f"| {miss} | {best} | {sweep} | {vs} |"
        )
    return lines + [""]


def _taus(g: dict, prefix: str = "") -> str:
    """A pool table cell: the tau counted on the timed prompts / the tau their calls decoded."""
    counted = g[f"{prefix}tau_timed"]
    return f"{counted:.2f} / {g.get(f'{prefix}tau_decoded', counted):.2f}"


def pool_markdown(rows: list[BenchRow]) -> list[str]:
    """The plans on many prompts (speed.check_plans_on_pool: the planned and best fixed trees' tau on the bench's
    prompts and more of the test split, the timed speedups carried to it) as markdown lines; none where it did not
    run."""
    planned = [r for r in rows if r.stats.get("pool") and r.stats.get("plan")]
    if not planned:
        return []
    g0 = planned[0].stats["pool"]
    n = g0["prompts"]
    lines = [
        f"tree=auto on {n} test prompts: each planned tree and the best fixed tree of its rule counted on them, "
        f"against the prompts its speedup was timed on (the head-to-head's, else the sweep's: the first of the "
        f"{n}), and that speedup carried to the {n} prompts' tau (x tau there / the tau the timed calls decoded: a "
        "decode of fixed length takes steps as 1 / tau). A few prompts' tau is their luck: the greedy chain's spreads "
        "by about 0.6 a prompt on the tiny world. T = 0: tau counted exactly (the decoder's own count replayed along "
        "the target's greedy continuations, EOS ignored; no decode). T > 0: a chain's tau by the product model (its "
        "expectation: one draw a level), alpha averaged over each prompt's sampled continuation; the timed calls' "
        "decoded tau also holds their draws' luck, which carrying removes; a tree with a multi-draw level is not "
        "carried (-). predicted / carried: the planner's prediction over the carried speedup.",
        "",
        "| T | row | timed prompts | tau, timed prompts: counted / decoded | tau, all | speedup, carried "
        "| predicted / carried | best fixed: tau, timed prompts: counted / decoded | tau, all | speedup, carried "
        "| planned / best fixed, carried |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in planned:
        g, pred = r.stats["pool"], r.stats["plan"].get("speedup")
        mine = ["-"] * 4
        if "speedup" in g:
            miss = f"{pred / g['speedup'] - 1:+.1%}" if pred is not None else "-"
            mine = [_taus(g), f"{g['tau']:.2f}", f"{g['speedup']:.2f}", miss]
        best = [g["best_fixed"] if g.get("best_fixed") else "-", "-", "-", "-"]
        if "best_speedup" in g:
            best = [
                f"{g['best_fixed']} {_taus(g, 'best_')}",
                f"{g['best_tau']:.2f}",
                f"{g['best_speedup']:.2f}",
                f"{g['ratio']:.3f}" if "ratio" in g else "-",
            ]
        lines.append(
            f"| {r.temperature:g} | {r.label} | {g['timed_prompts']} ({g['timed_by']}) | "
            + " | ".join(mine + best)
            + " |"
        )
    return lines + [""]


def log_wandb(rows: list[BenchRow], logger, output_dir: Path, run_name: str, meta: dict[str, Any]) -> None:
    """The same table and per-row speedups to W&B (offline by default) unless logger.wandb.mode is disabled."""
    cfg = logger.wandb
    if cfg.mode == "disabled":
        return
    import wandb

    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        mode=cfg.mode,
        dir=cfg.dir or str(output_dir),
        name=f"bench-{run_name}",
        job_type="bench",
        config=meta,
        reinit="finish_previous",
    )
    header, body = table_rows(rows)
    run.log(
        {
            "bench/table": wandb.Table(columns=header, data=body),
            "bench/speedup": wandb.Image(str(Path(output_dir) / "speedup.png")),
        }
    )
    for r in rows:
        key = f"T{r.temperature:g}/{r.label}"
        run.summary[f"tokens_per_second/{key}"] = r.tokens_per_second
        if r.speedup is not None:
            run.summary[f"speedup/{key}"] = r.speedup
        if r.tau is not None:
            run.summary[f"tau/{key}"] = r.tau
    run.finish()


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
