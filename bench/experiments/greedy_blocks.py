"""How far a few prompts' greedy tau sits from many prompts': trees counted on blocks of the test and eval splits.

python bench/experiments/greedy_blocks.py --draft <run>/distill/draft [--prompts 96] [--block 12]
    [--trees 1,1,1,1 2,1,1] -- [Hydra overrides of conf/distill.yaml, e.g. +recipe=tiny]

At temperature 0 a tree's tau on a prompt needs no decode: greedy_tau replays the decoder's own count along the
target's greedy continuation (48 tokens, EOS ignored), as the planner and the bench's T = 0 check
(speed.check_plans_on_pool) count it. For each split (test: the bench's prompts first; eval: the planner's) and
tree: tau over the first `--block` prompts (the bench times 12 test prompts), over the first 48, over all
`--prompts`, the standard deviation of a prompt's tau, and tau over each block of `--block`. Prints a markdown
table; the evidence it gave: docs/decoder_speed.md ("The plans on 96 test prompts").
"""

from __future__ import annotations

import statistics

from resispec.benchmark.experiment import experiment_parser, load_experiment, printed
from resispec.config import compose_typed
from resispec.data.prompts import load_heldout_prompts
from resispec.decoding.planner import greedy_continuations, greedy_hit_sets, greedy_tau
from resispec.decoding.planner.settle import SETTLE_TOKENS


def main(argv: list[str] | None = None) -> str:
    ap = experiment_parser(__doc__)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--block", type=int, default=12)
    ap.add_argument("--trees", nargs="+", default=["1,1,1,1", "2,1,1"])
    args = ap.parse_args(argv)
    cfg = compose_typed(args.overrides)
    target, draft, tokenizer = load_experiment(cfg, args.draft)
    trees = [[int(b) for b in t.split(",")] for t in args.trees]
    k = args.block
    lines = [
        f"greedy tau (replayed, {SETTLE_TOKENS} tokens a prompt, EOS ignored), draft {args.draft}",
        "",
        f"| split | tree | first {k} | first 48 | all {args.prompts} | sd a prompt | blocks of {k} |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for split in ("test", "eval"):
        prompts = load_heldout_prompts(cfg.data, tokenizer, cfg.world, args.prompts, split=split)
        hits = greedy_hit_sets(target, draft, prompts, greedy_continuations(target, prompts, SETTLE_TOKENS))
        for tree in trees:
            per = [greedy_tau(tree, [h]) for h in hits]
            blocks = " ".join(f"{greedy_tau(tree, hits[i : i + k]):.2f}" for i in range(0, len(hits), k))
            lines.append(
                f"| {split} | {tree} | {greedy_tau(tree, hits[:k]):.3f} | {greedy_tau(tree, hits[:48]):.3f} "
                f"| {greedy_tau(tree, hits):.3f} | {statistics.pstdev(per):.2f} | {blocks} |"
            )
    return printed(lines)


if __name__ == "__main__":
    main()
