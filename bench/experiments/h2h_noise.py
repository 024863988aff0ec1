"""The noise floor of a timed comparison: two decoders doing the very same work, timed as the bench times rows.

python bench/experiments/h2h_noise.py --draft <run>/distill/draft [--trials 4] [--tree 1 1 1 1 1]
    [--protocols 12x1 6x2 12x2 12x3] -- [Hydra overrides of conf/distill.yaml, e.g. +recipe=tiny]

Two SpeculativeDecoder instances with one rule and one tree (the same seeded decode, token for token) sit in a group
with AR and two other trees, as the planned and best fixed rows sit in the bench's head-to-head
(speed.time_fastest: each prompt through the group in turn, the order reversed every other prompt and pass, each
call counted at its fastest of the passes). A protocol "PxR" times P held-out prompts R passes; 12x1 is the sweep's
one call a prompt. Each trial gives the twins' ratio of tokens/s, which is 1 but for the machine; its spread over
the trials is what any planned / best fixed ratio timed that way carries. Prints a markdown table; the evidence it
gave: docs/decoder_speed.md.
"""

from __future__ import annotations

import statistics

import torch
from tqdm.auto import tqdm

from resispec.benchmark.config import BenchConfig
from resispec.benchmark.experiment import experiment_parser, load_experiment, printed
from resispec.benchmark.results import BenchRow
from resispec.benchmark.speed import _decoder_method, round_prompts, time_fastest
from resispec.config import compose_typed
from resispec.data.prompts import load_heldout_prompts
from resispec.decoding import SpeculativeDecoder
from resispec.verify import build_rule


def main(argv: list[str] | None = None) -> str:
    ap = experiment_parser(__doc__)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--tree", type=int, nargs="+", default=[1, 1, 1, 1, 1])
    ap.add_argument("--rule", default="resispec")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--protocols", nargs="+", default=["12x1", "6x2", "12x2", "12x3"])
    args = ap.parse_args(argv)
    cfg = compose_typed(args.overrides)
    target, draft, tokenizer = load_experiment(cfg, args.draft)
    bench = BenchConfig(max_new_tokens=48)
    protocols = [tuple(int(x) for x in p.split("x")) for p in args.protocols]
    prompts = load_heldout_prompts(cfg.data, tokenizer, cfg.world, max(p for p, _ in protocols))
    device = next(target.parameters()).device
    sampling = dict(temperature=args.temperature, top_p=cfg.decode.top_p, top_k=cfg.decode.top_k)

    def method(tree: list[int], name: str):
        dec = SpeculativeDecoder(target, draft, rule=build_rule(args.rule), tree=tree, tokenizer=tokenizer)
        fn = dec.generate if name != "AR" else dec.generate_autoregressive
        return _decoder_method(
            BenchRow("spec", args.temperature, rule=name, tree=str(tree)), fn, device, sampling
        )

    twin_a, twin_b = method(args.tree, "A"), method(args.tree, "B")
    group = [method([1], "AR"), twin_a, method([2, 1, 1, 1], "X"), twin_b, method([1, 1, 1, 1], "Y")]
    bar = tqdm(total=0, desc="trials", unit="gen")
    ratios: dict[tuple[int, int], list[float]] = {p: [] for p in protocols}
    seconds: dict[tuple[int, int], list[float]] = {p: [] for p in protocols}
    with torch.inference_mode():
        for m in group:  # warm-up
            m.run(prompts[0], 10_000, 8)
        for trial in range(args.trials):
            for num, repeats in protocols:  # interleaved, so a slow phase weighs on every protocol
                block = round_prompts(prompts[:num], 1)[0]
                t = bar.format_dict["elapsed"]
                tps, _ = time_fastest(
                    group, block, repeats, bench, device, bar, f"trial {trial + 1} {num}x{repeats}"
                )
                ratios[(num, repeats)].append(tps[id(twin_a)] / tps[id(twin_b)])
                seconds[(num, repeats)].append(bar.format_dict["elapsed"] - t)
    bar.close()
    lines = [
        f"twins' tokens/s ratio: {args.rule} {args.tree} at T = {args.temperature:g}, draft {args.draft}, "
        f"{args.trials} trials, a group of {len(group)} methods",
        "",
        "| protocol (prompts x passes) | ratios | standard deviation | largest \\|ratio - 1\\| | seconds a trial |",
        "|---|---|---:|---:|---:|",
    ]
    for p in protocols:
        r = ratios[p]
        sd = statistics.stdev(r) if len(r) > 1 else float("nan")
        lines.append(
            f"| {p[0]}x{p[1]} | {' '.join(f'{x:.3f}' for x in r)} | {sd:.1%} | {max(abs(x - 1) for x in r):.1%} "
            f"| {statistics.mean(seconds[p]):.0f} |"
        )
    return printed(lines)


if __name__ == "__main__":
    main()
