"""Compare distillation runs (the command: bench/compare.py).

`compare(run_dirs)`: one markdown row per finished run: the loss, steps, held-out simulated tau per rule after
training (the saved draft), and the draft's tau before training for reference.

The multi-seed protocol's pieces: `run_curve(cfg, ...)` runs one (loss, seed) as a plain distillation
(`resispec.training.distill`) that saves a checkpoint every `every` steps, then evaluates every checkpoint (and the
initial draft) on the held-out set at each temperature: simulated tau of the served rule (decode.rule) on the served
tree (decode.tree). `summarize(curves)` reports mean +- standard error over seeds at equal steps and at equal
wall-clock, the paired difference to the first loss; `plot_curves` draws tau against steps per loss (PNG).
Wall-clock is training time only: the run's median seconds per optimizer step (history.jsonl) times the step,
so evaluation and checkpoint writes, which cost the same for every loss, do not count.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import statistics
from pathlib import Path

from resispec.data import ensure_regenerated
from resispec.models import load_pair
from resispec.training import checkpoint as ckpt
from resispec.training import distill
from resispec.training.evaluation import eval_rule, evaluate, select_positions


def compare(run_dirs: list[Path], rules: list[str] | None = None) -> str:
    """A markdown table of held-out tau (after, per rule) for the runs in run_dirs (each holds metrics.json)."""
    runs = [(d, json.loads((Path(d) / "metrics.json").read_text())) for d in run_dirs]
    if not runs:
        return "(no runs)"
    rules = rules or list(runs[0][1]["after"]["tau"])
    head = ["run", "loss", "steps", "best step", "fkl after"] + [f"tau {r}" for r in rules]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    before = runs[0][1]["before"]
    lines.append(
        "| (initial draft) | - | 0 | - | "
        + f"{before['fkl']:.3f} | "
        + " | ".join(f"{before['tau'][r]:.3f}" for r in rules)
        + " |"
    )
    for d, m in runs:
        after = m["after"]
        cells = [
            Path(d).resolve().parent.name,
            m["loss"],
            str(m["steps"]),
            str(m["best_step"]),
            f"{after['fkl']:.3f}",
        ]
        cells += [f"{after['tau'][r]:.3f}" for r in rules]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the multi-seed protocol
def step_seconds(run_dir: Path) -> float:
    """Median seconds per optimizer step of a finished run (its history.jsonl, written with logger.log_every=1:
    each row's new tokens over its tokens/s). The median drops the steps that also paid for a checkpoint."""
    per_step, seen = [], 0
    for line in (run_dir / "history.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/tokens_per_s" in row:
            per_step.append((row["train/tokens"] - seen) / max(row["train/tokens_per_s"], 1e-9))
            seen = row["train/tokens"]
    return float(statistics.median(per_step)) if per_step else math.nan


def load_checkpoint_draft(draft, step_dir: Path):
    """The draft weights of an accelerate checkpoint (model.safetensors) loaded into `draft` (tied weights that
    accelerate dropped while saving are tied again)."""
    from safetensors.torch import load_file

    missing, unexpected = draft.load_state_dict(load_file(str(step_dir / "model.safetensors")), strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise ValueError(f"{step_dir}: checkpoint does not match the draft ({missing=}, {unexpected=})")
    draft.tie_weights()
    return draft


def run_curve(cfg, loss_name: str, seed: int, out: Path, every: int, temperatures: list[float]) -> dict:
    """Distill one (loss, seed) and evaluate its checkpoints. -> {"steps", "tau": {T: [...]}, "sec_per_step",
    "loss"}; tau at step 0 is the initial draft's."""
    run_dir = out / "runs" / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', loss_name)}_s{seed}"
    shutil.rmtree(
        run_dir, ignore_errors=True
    )  # a fresh run: history.jsonl appends, so no leftovers from a kill
    train = dataclasses.replace(
        cfg.train, seed=seed, eval_every=0, save_every=every, keep_checkpoints=10_000, output_dir=str(run_dir)
    )
    logger = dataclasses.replace(cfg.logger, log_every=1)
    logger.wandb = dataclasses.replace(logger.wandb, mode="disabled")
    result = distill(
        cfg.world, cfg.target, cfg.draft, cfg.data, cfg.decode, cfg.loss, cfg.optim, train, logger,
        output_dir=run_dir, name=run_dir.name,
    )  # fmt: skip
    import torch

    threads = torch.get_num_threads()
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    try:
        target, draft, tok = load_pair(cfg.target, cfg.draft, cfg.world)
        rows = ensure_regenerated(
            cfg.data, target, tok, "eval", cfg.world, target_id=cfg.target.path, progress=False
        )
        seqs = select_positions(
            [(list(r["prompt_ids"]), list(r["response_ids"])) for r in rows], train.eval_positions
        )
        rule = eval_rule(cfg.decode.rule)
        steps = [0] + ckpt.checkpoint_steps(result.output_dir / "checkpoints")
        tau: dict[str, list[float]] = {str(t): [] for t in temperatures}
        for step in steps:
            if step:
                load_checkpoint_draft(draft, ckpt.step_dir(result.output_dir / "checkpoints", step))
            for t in temperatures:
                decode = dataclasses.replace(cfg.decode, temperature=t)
                tau[str(t)].append(evaluate(target, draft, seqs, decode, [rule])["tau"][rule])
    finally:
        torch.set_num_threads(threads)
    return {
        "loss": result.metrics["loss"],
        "steps": steps,
        "tau": tau,
        "sec_per_step": step_seconds(result.output_dir),
    }


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n); 0 for one value)."""
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def _at_step(curve: dict, temp: str, step: float) -> float:
    """tau of a curve at `step`, linear between the evaluated steps (exact at them)."""
    steps, taus = curve["steps"], curve["tau"][temp]
    i = max(i for i, s in enumerate(steps) if s <= step)
    if i + 1 == len(steps):
        return taus[i]
    frac = (step - steps[i]) / (steps[i + 1] - steps[i])
    return taus[i] + frac * (taus[i + 1] - taus[i])


def summarize(
    curves: dict[str, dict[int, dict]],
    steps: list[int] | None = None,
    step_cost: dict[str, float] | None = None,
) -> str:
    """Markdown tables from {loss: {seed: curve}}: tau mean +- SE at equal steps (`steps`, default the last two
    evaluated) and at equal wall-clock (the training time the slowest loss needs for every step), and each
    loss's paired difference to the first loss (mean +- SE over the seeds both have). `step_cost` (seconds per
    step by entry or by its loss name) replaces the runs' own timings, e.g. one interleaved measurement when the
    machine's load changed between runs."""
    losses = list(curves)
    any_curve = next(iter(curves[losses[0]].values()))
    temps = list(any_curve["tau"])
    last = any_curve["steps"][-1]
    steps = steps or sorted({any_curve["steps"][len(any_curve["steps"]) // 2], last})
    sec = {name: statistics.fmean(c["sec_per_step"] for c in curves[name].values()) for name in losses}
    for name in losses:
        cost = (step_cost or {}).get(name, (step_cost or {}).get(name.split()[0]))
        sec[name] = cost if cost is not None else sec[name]
    budget = min(sec[name] * last for name in losses)  # the fastest loss's training time for every step
    cols = [(f"T={t} @{s} steps", t, {n: s for n in losses}) for t in temps for s in steps]
    equal_time = {n: min(last, int(budget / sec[n])) for n in losses}
    cols += [(f"T={t} @{budget:.0f}s", t, equal_time) for t in temps]
    base = losses[0]
    head = ["loss", "seeds", "s/step"] + [c[0] for c in cols] + [f"vs {base} T={t} @{last}" for t in temps]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in losses:
        runs = curves[name]
        label = " ".join(
            [runs[next(iter(runs))]["loss"], *name.split()[1:]]
        )  # the loss and its own overrides
        cells = [label, str(len(runs)), f"{sec[name]:.3f}"]
        for _, t, at in cols:
            m, se = mean_se([_at_step(c, t, at[name]) for c in runs.values()])
            cells.append(f"{m:.3f} ± {se:.3f}")
        for t in temps:
            shared = [s for s in runs if s in curves[base]]
            if name == base or not shared:
                cells.append("-")
                continue
            m, se = mean_se([_at_step(runs[s], t, last) - _at_step(curves[base][s], t, last) for s in shared])
            ref = statistics.fmean(_at_step(curves[base][s], t, last) for s in shared)
            cells.append(f"{m:+.3f} ± {se:.3f} ({100 * m / ref:+.1f}%)")
        lines.append("| " + " | ".join(cells) + " |")
    step_note = ", ".join(f"{n} {equal_time[n]}" for n in losses)
    lines.append(
        f"\nEqual wall-clock = {budget:.0f} s of training (the fastest loss's time for {last} steps); steps "
        f"reached in it: {step_note} (tau linear between evaluated steps). ± is one standard error over seeds; the "
        "last columns are paired by seed."
    )
    return "\n".join(lines)


def plot_curves(curves: dict[str, dict[int, dict]], path: Path, title: str = "") -> None:
    """tau against steps per loss (mean over seeds, band = +-1 SE), one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(next(iter(next(iter(curves.values())).values()))["tau"])
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.2), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for name, runs in curves.items():
            steps = next(iter(runs.values()))["steps"]
            stats = [mean_se([c["tau"][t][i] for c in runs.values()]) for i in range(len(steps))]
            m = [s[0] for s in stats]
            lo = [s[0] - s[1] for s in stats]
            hi = [s[0] + s[1] for s in stats]
            ax.plot(steps, m, marker=".", label=f"{name} (n={len(runs)})")
            ax.fill_between(steps, lo, hi, alpha=0.2)
        ax.set_xlabel("optimizer steps")
        ax.set_ylabel("held-out simulated tau")
        ax.set_title(f"{title} T={t}".strip())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
