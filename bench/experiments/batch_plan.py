"""The planner's batched buckets against fixed trees: the tree planned at `--rows` rows, timed beside AR and fixed
chains on the bench's test prompts, in batches of that many rows.

python bench/experiments/batch_plan.py --draft <run>/distill/draft [--rows 4] [--temperatures 1 0]
    [--rules resispec] [--trees 1,1,1 1,1,1,1 1,1,1,1,1] [--rounds 2] [-- Hydra overrides of conf/distill.yaml]

For each temperature and rule: Planner.choose_by_batch at sizes 1 and `--rows` (the server's buckets; the bench's
planner prompts), then every method decodes the `--test-prompts` test prompts `--rows` at a time (the batched
decoder; AR: its batched AR), 48 tokens a row, EOS ignored, each method once a round, the order reversed every
other round. A plan that says "do not speculate" at that size is timed as AR. Prints a markdown table: tokens per
second, speedup over batched AR and the planned row over the best fixed row (AR included). The times include each
batch's prefill and its last rows finishing, where the planner's prediction at a batched size comes from steady
steps (BatchedCalibrationDecodes): compare the choice, not the prediction. The evidence it gave:
docs/decoder_speed.md.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from resispec.benchmark.experiment import experiment_parser, load_experiment, planner_prompts, printed
from resispec.config import compose_typed
from resispec.data.prompts import load_heldout_prompts
from resispec.decoding.batch_ar import BatchedDecoder
from resispec.decoding.batch_spec import BatchedSpeculativeDecoder
from resispec.decoding.planner import Planner
from resispec.decoding.planner.settle import SETTLE_TOKENS


def decoder_for(target, draft, rule: str, tree: list[int] | None):
    """A maker of fresh batched decoders: the speculative one with `tree`, or batched AR (tree None)."""
    if tree is None:
        return lambda: BatchedDecoder(target)
    return lambda: BatchedSpeculativeDecoder(target, draft, rule, tree)


def timed(make, prompts, rows: int, settings: dict, seed: int) -> tuple[int, float]:
    """(tokens, seconds) of decoding `prompts` `rows` at a time with the decoder `make()` builds, rows seeded."""
    tokens, seconds = 0, 0.0
    for lo in range(0, len(prompts), rows):
        chunk = prompts[lo : lo + rows]
        per_row = [
            dict(
                settings,
                max_new_tokens=SETTLE_TOKENS,
                eos_token_id=[],
                generator=torch.Generator().manual_seed(seed + lo + i),
            )
            for i in range(len(chunk))
        ]
        dec = make()
        t0 = time.perf_counter()
        out = dec.generate(chunk, per_row)
        seconds += time.perf_counter() - t0
        tokens += sum(len(o) for o in out)
    return tokens, seconds


def main(argv: list[str] | None = None) -> str:
    ap = experiment_parser(__doc__)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--rules", nargs="+", default=["resispec"])
    ap.add_argument("--trees", nargs="+", default=["1,1,1", "1,1,1,1", "1,1,1,1,1"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--test-prompts", type=int, default=12)
    args = ap.parse_args(argv)
    cfg = compose_typed(args.overrides)
    target, draft, tokenizer = load_experiment(cfg, args.draft)
    calibration = planner_prompts(cfg, tokenizer)
    test = load_heldout_prompts(cfg.data, tokenizer, cfg.world, args.test_prompts)
    planner = Planner(target, calibration)
    fixed = [[int(b) for b in t.split(",")] for t in args.trees]
    lines = [
        f"batched buckets: {args.rows} rows, {len(test)} test prompts x {SETTLE_TOKENS} tokens, "
        f"{args.rounds} rounds; draft {args.draft}",
        "",
        "| T | rule | method | tok/s | speedup over batched AR | planned / best fixed |",
        "|---|---|---|---:|---:|---:|",
    ]
    for temperature in args.temperatures:
        sampling = dict(temperature=temperature, top_p=cfg.decode.top_p, top_k=cfg.decode.top_k)
        for rule in args.rules:
            plans = planner.choose_by_batch(draft, rule, sampling, [1, args.rows])
            plan = plans[args.rows]
            planned = list(plan.tree) if plan.speedup > 1.0 else None  # None: do not speculate at this size
            methods: dict[str, list[int] | None] = {"AR": None}
            methods.update({f"fixed {t}": t for t in fixed})
            methods[f"planned {planned if planned else 'AR'}"] = planned
            sums = {name: [0, 0.0] for name in methods}
            names = list(methods)
            for rnd in tqdm(range(args.rounds), desc=f"T={temperature:g} {rule}"):
                for name in names if rnd % 2 == 0 else reversed(names):
                    tree = methods[name]
                    tokens, seconds = timed(
                        decoder_for(target, draft, rule, tree), test, args.rows, sampling, 1000 * rnd
                    )
                    sums[name][0] += tokens
                    sums[name][1] += seconds
            tps = {name: t / s for name, (t, s) in sums.items()}
            best_fixed = max(v for name, v in tps.items() if not name.startswith("planned"))
            for name in names:
                ratio = f"{tps[name] / best_fixed:.3f}" if name.startswith("planned") else ""
                pred = f" (predicted {plan.speedup:.2f}x)" if name.startswith("planned") else ""
                lines.append(
                    f"| {temperature:g} | {rule} | {name}{pred} | {tps[name]:.1f} | {tps[name] / tps['AR']:.2f} "
                    f"| {ratio} |"
                )
            lines.append(f"| {temperature:g} | {rule} | batch-1 plan: {plans[1].tree} | | | |")
    return printed(lines)


if __name__ == "__main__":
    main()
