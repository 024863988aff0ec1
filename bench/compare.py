"""Compare distillation runs.

Finished runs:  python bench/compare.py outputs/distill/tiny_*/latest
    One markdown row per run: the loss, steps, held-out simulated tau per rule after training (the saved draft),
    and the draft's tau before training for reference.

The multi-seed protocol:  python bench/compare.py protocol --seeds 0 1 2 --losses fkl lk tvd \\
        --every 100 --temperatures 1 0.6 --out outputs/protocol/NAME -- +recipe=debug key=value ...
    Runs every (loss, seed) as a plain distillation (`resispec.training.distill`, the Hydra overrides after `--`
    plus `loss=<name> train.seed=<seed>`; a `--losses` entry may carry its own overrides, quoted:
    "fkl data.draft_fraction=0.5") that saves a checkpoint every `--every` steps, then evaluates every
    checkpoint (and the initial draft) on the held-out set at each temperature: simulated tau of the served rule
    (decode.rule) on the served tree (decode.tree). Reports mean +- standard error over seeds at equal steps and at
    equal wall-clock, the paired difference to the first loss, and draws tau against steps per loss (PNG).
    Wall-clock is training time only: the run's median seconds per optimizer step (history.jsonl) times the step,
    so evaluation and checkpoint writes, which cost the same for every loss, do not count. A (loss, seed) whose
    curve is already in <out>/protocol.json is not run again (a killed protocol resumes where it stopped).

argparse, not Hydra: the first form takes run folders, the protocol its own flags and then Hydra overrides of
conf/distill.yaml after `--` (composed here, once per (loss, seed)).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from resispec.analysis.compare import compare, plot_curves, run_curve, summarize
from resispec.config import compose_typed


def protocol(argv: list[str]) -> str:
    ap = argparse.ArgumentParser(prog="python bench/compare.py protocol")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--losses", nargs="+", default=["fkl", "lk", "tvd", "residual_tree"], help="conf/loss names"
    )
    ap.add_argument("--every", type=int, default=100, help="steps between evaluated checkpoints")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.6])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--report-only", action="store_true", help="only redraw the table and plot")
    ap.add_argument(
        "--step-cost",
        nargs="*",
        default=[],
        help="loss=seconds per step for the equal wall-clock columns (default: each run's own median)",
    )
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/distill.yaml (after --)")
    args = ap.parse_args(argv)
    record = args.out / "protocol.json"
    data = json.loads(record.read_text()) if record.exists() else {"overrides": args.overrides, "curves": {}}
    if not args.report_only:
        for seed in args.seeds:  # seed-major: an interrupted protocol still has every loss at the first seeds
            for name in args.losses:
                if str(seed) in data["curves"].get(name, {}):
                    continue
                start = time.perf_counter()
                loss, *extra = name.split()  # "fkl data.draft_fraction=0.5": a loss plus its own overrides
                cfg = compose_typed([*args.overrides, f"loss={loss}", *extra])
                curve = run_curve(cfg, name, seed, args.out, args.every, args.temperatures)
                curve["seconds"] = round(time.perf_counter() - start, 1)
                if record.exists():  # merge into the file as it is now: another protocol may share --out
                    merged = json.loads(record.read_text())["curves"]
                    for n, runs in data["curves"].items():
                        merged.setdefault(n, {}).update(runs)
                    data["curves"] = merged
                data["curves"].setdefault(name, {})[str(seed)] = curve
                args.out.mkdir(parents=True, exist_ok=True)
                record.write_text(json.dumps(data, indent=1))
                print(f"{name} seed {seed}: tau {json.dumps(curve['tau'])}", flush=True)
    names = [n for n in args.losses if n in data["curves"]]
    curves = {n: {int(s): c for s, c in data["curves"][n].items()} for n in names}
    step_cost = {k: float(v) for k, v in (item.rsplit("=", 1) for item in args.step_cost)}
    table = summarize(curves, step_cost=step_cost)
    (args.out / "table.md").write_text(table + "\n")
    plot_curves(curves, args.out / "tau_steps.png", args.title)
    return table


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["protocol"]:
        print(protocol(argv[1:]))
    else:
        print(compare([Path(a) for a in argv]))


if __name__ == "__main__":
    main()
