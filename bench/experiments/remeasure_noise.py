"""How noisy is the planner's prediction, estimator by estimator: the re-measure repeated on the same decodes.

python bench/experiments/remeasure_noise.py --draft <run>/distill/draft [--tree 1 1 1 1] [--repeats 8]
    [--temperature 0] [-- Hydra overrides of conf/distill.yaml, e.g. +recipe=tiny]

A planned chain's prediction is AR and the chain decoded on the planner's fresh rounds (REMEASURE_PASSES x
SETTLE_PROMPTS rounds, one prompt each, back to back), its tau the model's (T = 0: greedy_tau over every planner
prompt; T > 0: the product model), its speedup scaled to it. Here those rounds are decoded `--repeats` times, the
same prompts and seeds each time, so only the machine's timing differs between repeats, and each repeat's rounds
give the speedup by each estimator:
- sums: settle.trimmed_speedup x model tau / decoded tau (the planner's: a ratio of summed tokens/s over the rounds,
  the highest and lowest round ratio dropped);
- median: the median over rounds of each round's speedup x model tau / that round's decoded tau;
- fastest of 2: per round, the faster of two repeats' decodes (as the bench's head-to-head counts a call), then
  sums (one estimate per pair of repeats: twice the decodes).
Prints a markdown table: each estimator's mean, its spread over repeats (sd / mean) and its mean against the sums
estimator over every repeat's rounds pooled.
"""

from __future__ import annotations

import statistics

from tqdm.auto import tqdm

from resispec.benchmark.experiment import experiment_parser, load_experiment, planner_prompts, printed
from resispec.config import compose_typed
from resispec.decoding.planner import (
    Planner,
    expected_tau,
    greedy_continuations,
    greedy_hit_sets,
    greedy_tau,
)
from resispec.decoding.planner.settle import (
    REMEASURE_PASSES,
    SETTLE_PROMPTS,
    SETTLE_TOKENS,
    CalibrationDecodes,
    Decoded,
    decode_rounds,
    kept_rounds,
    trimmed_speedup,
)
from resispec.sampling import is_greedy


def by_sums(rounds: list[tuple[Decoded, Decoded]], tau_model: float) -> float:
    spec, ar = [r[1] for r in rounds], [r[0] for r in rounds]
    speedup, _ = trimmed_speedup(spec, ar)
    kept = sum((s for s, _ in kept_rounds(spec, ar)), Decoded())
    return speedup * tau_model / kept.tau


def by_median(rounds: list[tuple[Decoded, Decoded]], tau_model: float) -> float:
    return statistics.median(s.tokens_per_s / a.tokens_per_s * tau_model / s.tau for a, s in rounds)


def main(argv: list[str] | None = None) -> str:
    ap = experiment_parser(__doc__)
    ap.add_argument("--tree", type=int, nargs="+", default=[1, 1, 1, 1])
    ap.add_argument("--rule", default="resispec")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    cfg = compose_typed(args.overrides)
    target, draft, tokenizer = load_experiment(cfg, args.draft)
    prompts = planner_prompts(cfg, tokenizer)
    sampling = dict(temperature=args.temperature, top_p=cfg.decode.top_p, top_k=cfg.decode.top_k)
    rule = "greedy" if is_greedy(args.temperature) else args.rule
    if is_greedy(args.temperature):  # the planner's T = 0 tau: the decoder's own count on every prompt
        continuations = greedy_continuations(target, prompts, SETTLE_TOKENS)
        tau_model = greedy_tau(args.tree, greedy_hit_sets(target, draft, prompts, continuations))
    else:
        tau_model = expected_tau(args.tree, Planner(target, prompts).acceptance(draft, rule, sampling))
    decode = CalibrationDecodes(target, draft, rule, prompts, sampling)
    n = REMEASURE_PASSES * SETTLE_PROMPTS
    repeats: list[list[tuple[Decoded, Decoded]]] = []
    for _ in tqdm(range(args.repeats), desc="repeats"):
        rounds = decode_rounds([None, args.tree], decode, n, first=SETTLE_PROMPTS)
        repeats.append([(r[0], r[1]) for r in rounds])
    fastest = [  # repeats 2i and 2i + 1, round by round: the faster AR and the faster chain
        [
            tuple(min(a[k], b[k], key=lambda d: d.seconds) for k in (0, 1))
            for a, b in zip(repeats[i], repeats[i + 1], strict=True)
        ]
        for i in range(0, len(repeats) - 1, 2)
    ]
    pooled = by_sums([r for rep in repeats for r in rep], tau_model)
    estimates = {
        "sums": [by_sums(rep, tau_model) for rep in repeats],
        "median": [by_median(rep, tau_model) for rep in repeats],
        "fastest of 2 (sums)": [by_sums(f, tau_model) for f in fastest],
    }
    lines = [
        f"re-measure noise: {rule} {args.tree} at T = {args.temperature:g}, draft {args.draft}, model tau "
        f"{tau_model:.3f}, {n} rounds a repeat, {args.repeats} repeats; pooled (sums over all): {pooled:.3f}",
        "",
        "| estimator | mean | sd / mean | mean / pooled | each |",
        "|---|---:|---:|---:|---|",
    ]
    for name, xs in estimates.items():
        mean = statistics.fmean(xs)
        sd = statistics.pstdev(xs) / mean if len(xs) > 1 else 0.0
        each = " ".join(f"{x:.3f}" for x in xs)
        lines.append(f"| {name} | {mean:.3f} | {100 * sd:.1f}% | {mean / pooled:.3f} | {each} |")
    return printed(lines)


if __name__ == "__main__":
    main()
