"""Compare finished distillation runs:  python -m resispec.analysis.compare outputs/distill/tiny_*/latest

Prints one markdown row per run: the loss, steps, held-out simulated tau per rule after training (the saved
draft), and the draft's tau before training for reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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


if __name__ == "__main__":
    print(compare([Path(a) for a in sys.argv[1:]]))
