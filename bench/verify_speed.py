"""Verification throughput per rule:  python bench/verify_speed.py [--device cuda] [--vocab 32768 131072] [--draws 2 4 8]

Times propose + verify of B nodes (one fixed LM-like random pair per node, resispec/analysis/verify_speed.py) and
prints nodes/s per rule and the time relative to rrs in the same run. argparse, not Hydra: a micro-benchmark of the
verification rules alone, with no model, world or config group to compose.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from resispec.analysis.verify_speed import lm_like_pair, time_rules
from resispec.verify import VERIFIERS


def main(argv: list[str] | None = None) -> Table:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32_768, 131_072])
    parser.add_argument("--draws", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rules", nargs="+", default=sorted(VERIFIERS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rules = ["rrs"] + [r for r in args.rules if r != "rrs"]  # rrs first: the reference of the ratio column

    table = Table(
        title=f"verification throughput, B = {args.batch}, {device.type} ({torch.get_num_threads()} threads)"
    )
    for col in ("V", "n", "rule", "ms / batch", "nodes / s", "x rrs time"):
        table.add_column(col, justify="right" if col != "rule" else "left")
    for vocab in args.vocab:
        p, q = lm_like_pair(args.batch, vocab, device)
        for n in args.draws:
            secs = time_rules(rules, p, q, n, args.repeats)
            base = secs["rrs"]
            for name, sec in secs.items():
                table.add_row(
                    str(vocab),
                    str(n),
                    name,
                    f"{1e3 * sec:.1f}",
                    f"{args.batch / sec:,.0f}",
                    f"{sec / base:.2f}",
                )
            table.add_section()
    Console().print(table)
    return table


if __name__ == "__main__":
    main()
