"""Verification throughput per rule: `python -m resispec.analysis.verify_speed [--device cuda] [--vocab 32768 131072]`.

Times propose + verify of B nodes (one fixed LM-like random pair per node) and prints nodes/s per rule and
the time relative to rrs in the same run. Defaults: V in {32k, 128k}, n in {2, 4, 8}, B = 64, cuda if present.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from resispec.verify import VERIFIERS


def lm_like_pair(
    batch: int, vocab: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """p, q [B, V] float32: a heavy-tailed target and a correlated draft (Zipf-ish logits plus noise)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, vocab, generator=gen)
    p = torch.softmax(3.0 * z, -1)
    q = torch.softmax(2.5 * z + torch.randn(batch, vocab, generator=gen), -1)
    return p.to(device), q.to(device)


def time_rules(names: list[str], p: torch.Tensor, q: torch.Tensor, n: int, repeats: int) -> dict[str, float]:
    """Median seconds of propose + verify for the whole batch, per rule. Rules are timed round-robin, so load
    changes on a shared machine hit every rule alike and the ratios to rrs stay meaningful."""
    gen = torch.Generator(device=p.device).manual_seed(0)
    sync = torch.cuda.synchronize if p.device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        VERIFIERS[name].verify(p, VERIFIERS[name].propose(q, n, gen), gen)
    for _ in range(repeats):
        for name in names:
            rule = VERIFIERS[name]
            sync()
            t0 = time.perf_counter()
            rule.verify(p, rule.propose(q, n, gen), gen)
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


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
