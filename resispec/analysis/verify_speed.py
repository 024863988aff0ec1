"""Verification throughput per rule (the command: `python bench/verify_speed.py [--device cuda] [--vocab 32768 131072]`).

Times propose + verify of B nodes (one fixed LM-like random pair per node) and prints nodes/s per rule and
the time relative to rrs in the same run. Defaults: V in {32k, 128k}, n in {2, 4, 8}, B = 64, cuda if present.
"""

from __future__ import annotations

import time

import torch

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
