"""Headroom: per-node acceptance of every verification rule on a real (target, draft) pair, against the bounds.

    python -m resispec.verify.headroom +recipe=debug                 # micro world, a minute
    python -m resispec.verify.headroom +recipe=tiny --positions 200  # the tiny world (recipes/tiny/README.md)

Positional arguments are Hydra overrides of the `bench` primary config (any recipe's target/draft pair); options
start with `--`. Steps:
1. log the target and draft logits at held-out positions of the validation and test splits (stdlib text the
   models never trained on; `--source` picks another split pair);
2. for every temperature and n: per-node α of every rule in VERIFIERS, by closed form where the rule has one and
   by Monte Carlo (`--samples` runs per node, with standard errors) where it has none (rsd, gumbel, resispec_wor
   with n > 2), plus the bounds α*_iid (exact) and α*_wor (n = 2: min over p/q-sorted prefixes, an upper bound
   that matched exhaustive enumeration on every small case we tried; n > 2: the same prefixes with a rigorous
   lower bound on P(all draws in H), so still an upper bound on α*_wor);
3. calibrate the resispec_auto policy (a max-q threshold per n and the distinct rule) on the validation split and
   report it on the test split, next to the per-node oracle max(resispec, distinct rule);
4. write headroom.md (table), headroom.json (everything, incl. the policy: load it with AutoPolicy.load) and
   headroom.png (α against temperature per rule) into `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from resispec.verify import VERIFIERS, optimal_acceptance
from resispec.verify.auto import AutoPolicy, confidence_feature

Tensor = torch.Tensor
DEFAULT_TEMPERATURES = (1.0, 0.8, 0.6)
DEFAULT_DRAWS = (2, 4)
AUTO = "resispec_auto"
DISTINCT_CANDIDATES = ("gumbel", "rsd", "resispec_wor")
THRESHOLD_GRID = [0.0] + [round(0.05 * i, 2) for i in range(1, 20)] + [1.01]  # 1.01: never distinct


# ---------------------------------------------------------------------------------------------- logging (p, q)


@torch.no_grad()
def collect_logits(
    target, draft, token_windows: list[list[int]], positions_per_window: int, min_context: int, seed: int
) -> tuple[Tensor, Tensor]:
    """Target and draft logits at random positions of held-out token windows -> ([N, V], [N, V]) float32 (CPU).
    Both models see the same prefix; a position's logits predict the token after it."""
    gen = torch.Generator().manual_seed(seed)
    dev_t = next(target.parameters()).device
    dev_d = next(draft.parameters()).device
    out_t, out_d = [], []
    for ids in tqdm(token_windows, desc="logging (p, q)", leave=False):
        x = torch.tensor([ids])
        span = len(ids) - min_context
        pos = min_context + torch.randperm(span, generator=gen)[:positions_per_window].sort().values
        lt = target(input_ids=x.to(dev_t)).logits[0, pos.to(dev_t)].float().cpu()
        ld = draft(input_ids=x.to(dev_d)).logits[0, pos.to(dev_d)].float().cpu()
        vocab = min(lt.shape[-1], ld.shape[-1])  # padded lm heads: keep the shared vocabulary
        out_t.append(lt[:, :vocab])
        out_d.append(ld[:, :vocab])
    return torch.cat(out_t), torch.cat(out_d)


def token_windows(
    tokenizer, texts: list[str], num_windows: int, window: int, min_context: int
) -> list[list[int]]:
    """num_windows windows of up to `window` tokens: consecutive chunks of each text in turn, texts round-robin,
    so a split with few files still gives enough positions (and many files give one window each)."""
    chunks_per_text = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        chunks = [ids[i : i + window] for i in range(0, len(ids), window)]
        chunks_per_text.append([c for c in chunks if len(c) >= min_context + 2])
    out: list[list[int]] = []
    depth = 0
    while len(out) < num_windows and any(depth < len(c) for c in chunks_per_text):
        for chunks in chunks_per_text:
            if depth < len(chunks) and len(out) < num_windows:
                out.append(chunks[depth])
        depth += 1
    return out


def node_pairs(target_logits: Tensor, draft_logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """p, q [N, V] after the same temperature (float64: the solvers and sums are exact enough)."""
    p = torch.softmax(target_logits.double() / temperature, -1)
    q = torch.softmax(draft_logits.double() / temperature, -1)
    return p, q


# ---------------------------------------------------------------------------------------------- bounds


def wor_prefix_bound(p: Tensor, q: Tensor, n: int, grid_size: int = 400) -> Tensor:
    """Upper bound on α*_wor [N]: min over prefixes H of the tokens sorted by increasing p/q of
    p(H) + 1 - P(all n distinct draws lie in H). n = 2: P = q(H) Σ_H q/(1-q) - Σ_H q²/(1-q) exactly.
    n > 2: P by exponential races (draws without replacement = order of arrival of clocks with rates q),
        P(S ⊆ H) = ∫ P(at least n of H arrived by u) d(1 - exp(-q(H^c) u)),
    bracketed from below on a log grid of u (the integrand increases in u), so the result stays an upper bound."""
    w = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(p, float("inf")))
    order = torch.argsort(w, dim=-1)
    p_s, q_s = p.gather(-1, order).double(), q.gather(-1, order).double()  # [N, V]
    p_h = torch.cumsum(p_s, -1)  # [N, V] p(H_k), k = 1..V
    if n == 2:
        q_h = torch.cumsum(q_s, -1)
        a = torch.cumsum(q_s / (1 - q_s).clamp_min(1e-300), -1)
        b = torch.cumsum(q_s**2 / (1 - q_s).clamp_min(1e-300), -1)
        inside = (q_h * a - b).clamp(0, 1)
    else:
        u = torch.logspace(-3, 7, grid_size, dtype=torch.float64)  # [G]
        state = torch.zeros(
            p.shape[0], grid_size, n + 1, dtype=torch.float64
        )  # P(count = j), j = n means >= n
        state[..., 0] = 1.0
        q_out = (1 - torch.cumsum(q_s, -1)).clamp_min(0)  # [N, V] q(H^c)
        inside = torch.ones_like(p_s)  # [N, V]; H = support (q(H^c) = 0): always inside
        for k in range(p.shape[1]):
            arrived = -torch.expm1(-q_s[:, k, None] * u)  # [N, G]
            moved = state[..., :n] * arrived[..., None]  # [N, G, n]
            state = state.clone()
            state[..., :n] -= moved
            state[..., 1:] += moved
            cdf = -torch.expm1(-q_out[:, k, None] * u)  # [N, G] law of the first arrival outside H
            step = torch.diff(cdf, dim=-1, append=torch.ones_like(cdf[:, :1]))  # mass of [u_g, u_{g+1})
            lower = (state[..., n] * step).sum(-1).clamp(0, 1)  # left end: the integrand increases in u
            inside[:, k] = torch.where(q_out[:, k] > 0, lower, inside[:, k])
    vals = p_h + 1 - inside
    return torch.minimum(vals.min(-1).values, torch.ones_like(vals[:, 0]))


# ---------------------------------------------------------------------------------------------- per-node alpha


def monte_carlo_alpha(
    rule, p: Tensor, q: Tensor, n: int, samples: int, generator: torch.Generator, chunk_rows: int = 1 << 21
) -> tuple[Tensor, Tensor]:
    """Per-node acceptance rate of rule.propose + rule.verify, and its standard error. p, q [N, V] -> [N], [N]."""
    nodes_per_chunk = max(1, chunk_rows // (samples * p.shape[-1]))
    rates = []
    for start in range(0, p.shape[0], nodes_per_chunk):
        pp = p[start : start + nodes_per_chunk].repeat_interleave(samples, 0)
        qq = q[start : start + nodes_per_chunk].repeat_interleave(samples, 0)
        _, slot = rule.verify(pp, rule.propose(qq, n, generator), generator)
        rates.append((slot >= 0).double().view(-1, samples).mean(-1))
    rate = torch.cat(rates)
    return rate, (rate * (1 - rate) / samples).sqrt()


def per_node_alpha(
    p: Tensor,
    q: Tensor,
    n: int,
    rules: list[str],
    samples: int,
    generator: torch.Generator,
    bounds: bool = True,
) -> dict[str, dict]:
    """{rule: {"alpha": [N], "se": [N], "method": "closed form" | "monte carlo"}} plus the two bounds."""
    out: dict[str, dict] = {}
    for name in rules:
        rule = VERIFIERS[name]
        try:
            alpha = rule.acceptance(p, q, n).double()
            out[name] = {"alpha": alpha, "se": torch.zeros_like(alpha), "method": "closed form"}
        except NotImplementedError:
            alpha, se = monte_carlo_alpha(rule, p, q, n, samples, generator)
            out[name] = {"alpha": alpha, "se": se, "method": "monte carlo"}
    if not bounds:
        return out
    iid = optimal_acceptance(p, q, n, scheme="iid").double()
    out["alpha*_iid"] = {"alpha": iid, "se": torch.zeros_like(iid), "method": "exact bound"}
    wor = wor_prefix_bound(p, q, n)
    out["alpha*_wor"] = {
        "alpha": wor,
        "se": torch.zeros_like(wor),
        "method": "prefix bound (exact on enumerated cases)" if n == 2 else "prefix bound (upper)",
    }
    return out


def auto_alpha(
    per_node: dict[str, dict], feature: Tensor, threshold: float, distinct_rule: str, iid_rule: str
):
    """resispec_auto's per-node α is its branch's per-node α: distinct where feature >= threshold (max q)."""
    mask = feature >= threshold
    d, i = per_node[distinct_rule], per_node[iid_rule]
    return torch.where(mask, d["alpha"], i["alpha"]), torch.where(mask, d["se"], i["se"]), mask


def calibrate_policy(
    results: dict, draws: list[int], iid_rule: str = "resispec", candidates=DISTINCT_CANDIDATES
) -> AutoPolicy:
    """Per n, the distinct rule and max-q threshold that maximise mean α summed over the temperatures of the
    calibration split. results[(T, n)] = {"per_node": ..., "feature": [N]}. Ties: the threshold nearest 0.3."""
    thresholds, rules = {}, {}
    for n in draws:
        keys = [k for k in results if k[1] == n]
        best = None
        for rule in candidates:
            if not all(rule in results[k]["per_node"] for k in keys):
                continue
            for t in THRESHOLD_GRID:
                s = sum(
                    float(
                        auto_alpha(results[k]["per_node"], results[k]["feature"], t, rule, iid_rule)[0].mean()
                    )
                    for k in keys
                )
                cand = (s, -abs(t - 0.3), t, rule)
                best = cand if best is None or cand[:2] > best[:2] else best
        assert best is not None, "no distinct rule candidate was measured"
        thresholds[n], rules[n] = best[2], best[3]
    default = max(set(rules.values()), key=list(rules.values()).count)
    return AutoPolicy(
        feature="max_q",
        threshold=0.3,
        thresholds=thresholds,
        iid_rule=iid_rule,
        distinct_rule=default,
        distinct_rules={n: r for n, r in rules.items() if r != default},
    )


# ---------------------------------------------------------------------------------------------- report


def summarize(per_node: dict[str, dict]) -> dict[str, dict]:
    """Mean α over nodes and the Monte Carlo standard error of that mean (nodes fixed)."""
    out = {}
    for name, r in per_node.items():
        num = r["alpha"].numel()
        out[name] = {
            "mean": float(r["alpha"].mean()),
            "mc_se": float(r["se"].pow(2).sum().sqrt() / num),
            "method": r["method"],
        }
    return out


def markdown_table(summary: dict, rules: list[str], temperatures, draws) -> str:
    cols = rules + [AUTO, "oracle", "alpha*_iid", "alpha*_wor"]
    lines = ["| n | T | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for n in draws:
        for t in temperatures:
            row = summary[f"n={n},T={t}"]
            best_other = max(row[r]["mean"] for r in rules)
            cells = []
            for c in cols:
                v = row[c]
                s = f"{v['mean']:.3f}"
                if v["mc_se"] > 0:
                    s += f" ±{v['mc_se']:.3f}"
                if c in rules and v["mean"] == best_other or c == AUTO and v["mean"] >= best_other:
                    s = f"**{s}**"
                cells.append(s)
            lines.append(f"| {n} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict, rules: list[str], temperatures, draws, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(draws), figsize=(6 * len(draws), 4.5), squeeze=False)
    names = rules + [AUTO, "alpha*_iid", "alpha*_wor"]
    colors = plt.get_cmap("tab20")(range(len(names)))
    for ax, n in zip(axes[0], draws, strict=True):
        for name, color in zip(names, colors, strict=True):
            ys = [summary[f"n={n},T={t}"][name]["mean"] for t in temperatures]
            es = [summary[f"n={n},T={t}"][name]["mc_se"] for t in temperatures]
            style = "--" if name.startswith("alpha*") else "-"
            width = 2.5 if name == AUTO else 1.2
            ax.errorbar(
                temperatures,
                ys,
                yerr=es,
                label=name,
                color=color,
                linestyle=style,
                linewidth=width,
                marker="o",
                ms=3,
            )
        ax.set_title(f"per-node acceptance, n = {n} (test split)")
        ax.set_xlabel("temperature")
        ax.set_ylabel("mean α")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main


def evaluate_split(
    target_logits, draft_logits, temperatures, draws, rules, samples, seed, progress, bounds=True
) -> dict:
    """{(T, n): {"per_node": ..., "feature": max q [N]}} for one split."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in temperatures:
        p, q = node_pairs(target_logits, draft_logits, t)
        for n in draws:
            out[(t, n)] = {
                "per_node": per_node_alpha(p, q, n, rules, samples, gen, bounds),
                "feature": confidence_feature(q, "max_q"),
            }
            progress.update(1)
    return out


def run(args: argparse.Namespace, overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    from resispec.config import register_configs, to_typed
    from resispec.models import load_pair, stdlib_splits

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    register_configs()
    conf_dir = Path(args.conf_dir or Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base="1.3"):
        cfg = to_typed(compose(config_name="bench", overrides=overrides))
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, cfg.world)
    target.eval()
    draft.eval()
    splits = stdlib_splits(cfg.world)
    rules = [r for r in (args.rules or sorted(VERIFIERS)) if r != AUTO]
    temperatures, draws = list(args.temperatures), list(args.draws)
    logged = {}
    for split, num in (
        (args.calibration_split, args.calibration_positions or args.positions),
        (args.eval_split, args.positions),
    ):
        wins = token_windows(
            tokenizer, splits[split], math.ceil(num / args.per_window), args.window, args.min_context
        )
        lt, ld = collect_logits(target, draft, wins, args.per_window, args.min_context, args.seed)
        logged[split] = (lt[:num], ld[:num])
    candidates = [c for c in args.candidates if c in rules]
    calib_rules = [r for r in rules if r == "resispec" or r in candidates]
    t0 = time.time()
    with tqdm(total=2 * len(temperatures) * len(draws), desc="alpha per rule") as bar:
        calib = evaluate_split(
            *logged[args.calibration_split],
            temperatures,
            draws,
            calib_rules,
            args.samples,
            args.seed,
            bar,
            False,
        )
        test = evaluate_split(
            *logged[args.eval_split], temperatures, draws, rules, args.samples, args.seed + 1, bar
        )
    policy = calibrate_policy(calib, draws, candidates=tuple(candidates))
    summary, branch_share = {}, {}
    for (t, n), r in test.items():
        per_node = dict(r["per_node"])
        a, se, mask = auto_alpha(
            per_node, r["feature"], policy.threshold_for(n), policy.distinct_rule_for(n), policy.iid_rule
        )
        per_node[AUTO] = {
            "alpha": a,
            "se": se,
            "method": f"per node: {policy.distinct_rule_for(n)} | {policy.iid_rule}",
        }
        d, i = per_node[policy.distinct_rule_for(n)], per_node[policy.iid_rule]
        per_node["oracle"] = {
            "alpha": torch.maximum(d["alpha"], i["alpha"]),
            "se": torch.maximum(d["se"], i["se"]),
            "method": "per-node max (optimistic)",
        }
        summary[f"n={n},T={t}"] = summarize(per_node)
        branch_share[f"n={n},T={t}"] = float(mask.double().mean())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m resispec.verify.headroom " + " ".join(overrides + args.raw_options)
    table = markdown_table(summary, rules, temperatures, draws)
    report = {
        "command": command,
        "world": cfg.world.name,
        "target": cfg.target.path,
        "draft": cfg.draft.path,
        "positions": {s: int(v[0].shape[0]) for s, v in logged.items()},
        "vocab": int(logged[args.eval_split][0].shape[-1]),
        "samples_per_node": args.samples,
        "calibration_split": args.calibration_split,
        "eval_split": args.eval_split,
        "policy": asdict(policy),
        "distinct_share": branch_share,
        "summary": summary,
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "headroom.json").write_text(json.dumps(report, indent=2) + "\n")
    policy.save(out_dir / "auto_policy.json")
    header = (
        f"Per-node acceptance α on the {args.eval_split} split ({report['positions'][args.eval_split]} positions, "
        f"{cfg.world.name} world, V = {report['vocab']}); ± = Monte Carlo standard error of the mean "
        f"({args.samples} runs per node). resispec_auto policy calibrated on {args.calibration_split}: "
        f"distinct rule per n {dict((n, policy.distinct_rule_for(n)) for n in draws)}, max-q thresholds {policy.thresholds}.\n\n"
        f"Command: `{command}`\n\n"
    )
    (out_dir / "headroom.md").write_text(header + table + "\n")
    plot(summary, rules, temperatures, draws, out_dir / "headroom.png")
    print(header + table)
    print(f"wrote {out_dir}/headroom.md, headroom.json, headroom.png, auto_policy.json")
    return report


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/bench.yaml, e.g. +recipe=debug")
    ap.add_argument("--positions", type=int, default=120, help="held-out positions per split")
    ap.add_argument("--calibration-positions", type=int, default=None, help="default: --positions")
    ap.add_argument(
        "--candidates",
        nargs="+",
        default=list(DISTINCT_CANDIDATES),
        help="distinct rules auto may calibrate to",
    )
    ap.add_argument("--per-window", type=int, default=4, help="positions per text window")
    ap.add_argument("--window", type=int, default=192, help="tokens per window")
    ap.add_argument("--min-context", type=int, default=16)
    ap.add_argument("--samples", type=int, default=100, help="Monte Carlo runs per node")
    ap.add_argument("--temperatures", type=float, nargs="+", default=list(DEFAULT_TEMPERATURES))
    ap.add_argument("--draws", type=int, nargs="+", default=list(DEFAULT_DRAWS))
    ap.add_argument("--rules", nargs="+", default=None, help="default: every rule in VERIFIERS")
    ap.add_argument("--calibration-split", default="validation")
    ap.add_argument("--eval-split", default="test")
    ap.add_argument("--out", default="outputs/headroom")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for these small ops)")
    ap.add_argument("--conf-dir", default=None)
    argv = list(argv) if argv is not None else None
    args = ap.parse_args(argv)
    import sys

    raw = argv if argv is not None else sys.argv[1:]
    args.raw_options = [a for a in raw if a not in args.overrides]
    return args, args.overrides


def main(argv: list[str] | None = None) -> dict:
    args, overrides = parse(argv)
    return run(args, overrides)


if __name__ == "__main__":
    main()
