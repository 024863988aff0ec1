"""A chain's tau: the planner's product model against many seeded decodes, on the planner's and the bench's prompts.

python bench/experiments/chain_tau.py --draft <run>/distill/draft [--temperature 1] [--seeds 8] [--depths 2 3 4 5 6]
    [--rules resispec resispec_auto] [--test-prompts 12] [-- Hydra overrides of conf/distill.yaml, e.g. +recipe=tiny]

For each rule and chain [1]*d: the tau of the planner's product model (alpha calibrated as the Planner calibrates
it, on the first SETTLE_PROMPTS validation prompts), and the tau decoded over `--seeds` seeded draws (48 tokens, EOS
ignored, as the planner's settling decodes) of each of those calibration prompts, of the bench's other planner
prompts that the fresh rounds decode (validation prompts SETTLE_PROMPTS .. 3 x SETTLE_PROMPTS - 1) and of
`--test-prompts` test prompts. At T > 0 the planner takes the model's tau for a chain (resispec/decoding/planner/
settle.py as_measured): a chain draws once a level, so the product model is its expectation, where four
calibration decodes are the noisier estimate. At T = 0 (greedy: one seed is enough) the planner does not use the
product model: it counts every tree's tau exactly on all its prompts (greedy_tau), and the columns show how far
prompt sets of this size disagree. The evidence on both: docs/decoder_speed.md.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from resispec.benchmark.experiment import experiment_parser, load_experiment, printed
from resispec.config import compose_typed
from resispec.data.prompts import load_heldout_prompts
from resispec.decoding import SpeculativeDecoder
from resispec.decoding.planner import Planner, expected_tau
from resispec.decoding.planner.settle import REMEASURE_PASSES, SETTLE_PROMPTS, SETTLE_TOKENS


def decoded(decoder, prompts, seeds: int, settings: dict, bar) -> tuple[int, int]:
    """(accepted plus one per step, steps), summed over `seeds` seeded decodes of every prompt: tau is their
    ratio."""
    steps = accepted = 0
    for i, p in enumerate(prompts):
        for s in range(seeds):
            gen = torch.Generator().manual_seed(50_000 + 100 * i + s)
            stats = decoder.generate(
                torch.tensor([p]), generator=gen, max_new_tokens=SETTLE_TOKENS, eos_token_id=[], **settings
            ).stats
            steps, accepted = steps + stats.num_drafts, accepted + stats.num_accepted_tokens
            bar.update()
    return accepted + steps, steps


def main(argv: list[str] | None = None) -> str:
    ap = experiment_parser(__doc__)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    ap.add_argument("--rules", nargs="+", default=["resispec"])
    ap.add_argument("--test-prompts", type=int, default=12)
    args = ap.parse_args(argv)
    cfg = compose_typed(args.overrides)
    target, draft, tokenizer = load_experiment(cfg, args.draft)
    planner_prompts = load_heldout_prompts(
        cfg.data, tokenizer, cfg.world, SETTLE_PROMPTS * (1 + REMEASURE_PASSES), split="eval"
    )  # the ones the planner's decodes use (at T = 0 it counts tau on all of bench.plan_calibration_prompts)
    calibration, fresh = planner_prompts[:SETTLE_PROMPTS], planner_prompts[SETTLE_PROMPTS:]
    test = load_heldout_prompts(cfg.data, tokenizer, cfg.world, args.test_prompts)
    settings = dict(temperature=args.temperature, top_p=cfg.decode.top_p, top_k=cfg.decode.top_k)
    planner = Planner(target, calibration)
    lines = [
        f"chain tau at T = {args.temperature:g}: product model vs decoded ({args.seeds} seeds x prompt, "
        f"{SETTLE_TOKENS} tokens, EOS ignored); draft {args.draft}",
        "",
        f"| rule | chain | model tau | decoded: {len(calibration)} calibration prompts "
        f"| decoded: {len(fresh)} fresh-round prompts | decoded: those {len(planner_prompts)} together "
        f"| decoded: {len(test)} test prompts | model / test |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    total = len(args.rules) * len(args.depths) * args.seeds * len(planner_prompts + test)
    with tqdm(total=total, desc="chain tau decodes") as bar:
        for rule in args.rules:
            alpha = planner.acceptance(draft, rule, settings)
            for d in args.depths:
                tree = [1] * d
                decoder = SpeculativeDecoder(target, draft, rule=rule, tree=tree)
                model = expected_tau(tree, alpha)
                cal, later, held = (
                    decoded(decoder, ps, args.seeds, settings, bar) for ps in (calibration, fresh, test)
                )
                both = (cal[0] + later[0], cal[1] + later[1])
                taus = [a / b for a, b in (cal, later, both, held)]
                cells = " | ".join(f"{t:.3f}" for t in taus)
                lines.append(f"| {rule} | {tree} | {model:.3f} | {cells} | {model / taus[-1]:.3f} |")
    return printed(lines)


if __name__ == "__main__":
    main()
