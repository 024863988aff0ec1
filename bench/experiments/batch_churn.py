"""Tokens per second of the batched speculative decoder under churn, timed alone (no server, no HTTP): R rows
decode, a finished row is replaced by a new request, at most one admission per step boundary (as the server's
scheduler admits while rows run), so rows finish and join at staggered steps, which is where joining and leaving
cost shows. Every row takes AR steps (`--mode ar`) or drafts the tree (`--mode spec`).

python bench/experiments/batch_churn.py --draft <run>/distill/draft [--rows 16] [--mode ar spec] [--requests 96]

To compare two versions of the code, run it alternately from each checkout (PYTHONPATH=<checkout>), several rounds:
the machine's speed drifts by tens of percent within minutes (docs/journal/tiny.md, "Joining and leaving").
"""

from __future__ import annotations

import argparse
import time

import torch

from resispec.data.config import DataConfig
from resispec.data.prompts import load_heldout_prompts
from resispec.decoding import SpeculativeDecoder
from resispec.decoding.batch import BatchedSpeculativeDecoder
from resispec.models import load_pair
from resispec.models.config import ModelConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="world:target")
    ap.add_argument("--draft", default="world:draft")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--mode", nargs="+", choices=["ar", "spec"], default=["ar", "spec"])
    ap.add_argument("--tree", type=int, nargs="+", default=[1])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tok = load_pair(ModelConfig(path=args.target), ModelConfig(path=args.draft))
    prompts = load_heldout_prompts(DataConfig(), tok, None, 8)
    dec = SpeculativeDecoder(target, draft, rule="resispec", tree=args.tree, tokenizer=tok)
    for mode in args.mode:
        batch = BatchedSpeculativeDecoder.from_decoder(dec)
        drafting = mode == "spec"
        started = 0

        def admit(batch=batch) -> None:
            nonlocal started
            gen = torch.Generator().manual_seed(started)
            prompt = list(prompts[started % len(prompts)])
            batch.add(prompt, args.max_new_tokens, args.temperature, eos_token_id=[], generator=gen)
            started += 1

        for _ in range(args.rows):  # warm-up, then the same start as the server's: one wave
            admit()
        for _ in range(10):
            batch.step(drafting)
        batch.reset()
        started = 0
        for _ in range(args.rows):
            admit()
        waiting, tokens, t0 = 0, 0, time.perf_counter()
        while batch.rows or waiting:
            if waiting:
                admit()
                waiting -= 1
            out = batch.step(drafting)
            tokens += sum(len(chunk) for _, chunk in out)
            finished = sum(row.finished for row, _ in out)
            waiting += min(finished, args.requests - started - waiting)
        seconds = time.perf_counter() - t0
        print(
            f"{mode} rows={args.rows} T={args.temperature:g}: {tokens / seconds:.1f} tok/s "
            f"({started} requests, {tokens} tokens, {seconds:.1f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
