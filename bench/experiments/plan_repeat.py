"""The planner's repeatability: one draft planned again and again in one process, the same prompts and seeds.

python bench/experiments/plan_repeat.py --draft <run>/distill/draft [--repeats 4] [--temperatures 1 0]
    [--rules resispec resispec_auto] [-- Hydra overrides of conf/distill.yaml, e.g. +recipe=tiny]

Each plan is what the bench's `tree=auto` row starts from (Planner.choose on the bench's planner prompts, the
validation split): the tree chosen, its predicted speedup (the fresh rounds), the speedup it was chosen at (the
settling) and the start-up. Between repeats only the machine's timing changes (a chain's tau at T > 0 is the
model's, and every decode is seeded), so the spread of the predictions of one tree is the timing noise a
prediction carries. Prints a markdown table; the evidence it gave: docs/decoder_speed.md.
"""

from __future__ import annotations

import statistics

from tqdm.auto import tqdm

from resispec.benchmark.experiment import experiment_parser, load_experiment, planner_prompts, printed
from resispec.config import compose_typed
from resispec.decoding.planner import Planner


def main(argv: list[str] | None = None) -> str:
    ap = experiment_parser(__doc__)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--rules", nargs="+", default=["resispec", "resispec_auto"])
    args = ap.parse_args(argv)
    cfg = compose_typed(args.overrides)
    target, draft, tokenizer = load_experiment(cfg, args.draft)
    prompts = planner_prompts(cfg, tokenizer)
    planner = Planner(target, prompts)
    lines = [
        f"planner repeatability: draft {args.draft}, {args.repeats} plans each",
        "",
        "| T | rule | repeat | tree | predicted speedup | chosen at | start-up s |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    by_tree: dict[tuple, list[float]] = {}
    runs = [(t, r, i) for t in args.temperatures for r in args.rules for i in range(args.repeats)]
    for temperature, rule, i in tqdm(runs, desc="plans"):
        sampling = dict(temperature=temperature, top_p=cfg.decode.top_p, top_k=cfg.decode.top_k)
        plan = planner.choose(draft, rule, sampling)
        tree = list(plan.tree)
        by_tree.setdefault((temperature, str(tree)), []).append(plan.speedup)
        lines.append(
            f"| {temperature:g} | {rule} | {i} | {tree} | {plan.speedup:.3f} | {'-' if plan.selected_speedup is None else f'{plan.selected_speedup:.3f}'} "
            f"| {plan.startup_s:.1f} |"
        )
    lines += [
        "",
        "| T | tree | times chosen | predicted speedup: range | standard deviation / mean |",
        "|---|---|---:|---|---:|",
    ]
    for (temperature, tree), sp in by_tree.items():
        spread = f"{statistics.stdev(sp) / statistics.mean(sp):.1%}" if len(sp) > 1 else "-"
        lines.append(f"| {temperature:g} | {tree} | {len(sp)} | {min(sp):.3f}-{max(sp):.3f} | {spread} |")
    return printed(lines)


if __name__ == "__main__":
    main()
