"""Headroom: per-node acceptance of every verification rule on a real (target, draft) pair, against the bounds.

    python bench/headroom.py +recipe=debug                                  # micro world, a minute
    python bench/headroom.py +recipe=tiny headroom.positions=200            # the tiny world (docs/headroom.md)

Options are the `headroom` config group (conf/headroom/default.yaml, resispec/analysis/config.py); any recipe's
target/draft pair can be measured. Steps:
1. log the target and draft logits at held-out positions of the validation and test splits (stdlib text the
   models never trained on; `headroom.calibration_split` / `headroom.eval_split` pick other splits);
2. for every temperature and n: per-node α of every rule in VERIFIERS, by closed form where the rule has one and
   by Monte Carlo (`headroom.samples` runs per node, with standard errors) where it has none (rsd, gumbel,
   resispec_wor with n > 2), plus the bounds α*_iid (exact) and α*_wor (resispec.verify.bounds.wor_prefix_bound:
   n = 2: min over p/q-sorted prefixes, an upper bound that matched exhaustive enumeration on every small case we
   tried; n > 2: the same prefixes with a rigorous lower bound on P(all draws in H), so still an upper bound);
3. calibrate the resispec_auto policy (a max-q threshold per n and the distinct rule) on the validation split and
   report it on the test split, next to the per-node oracle max(resispec, distinct rule);
4. write headroom.md (table), headroom.json (everything, incl. the policy), auto_policy.json (serve it with
   `decode.auto_policy=<path>`) and headroom.png (α against temperature per rule) into the output folder.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from resispec.analysis.config import HeadroomConfig
from resispec.models import load_pair, stdlib_splits
from resispec.models.config import ModelConfig, WorldConfig
from resispec.verify import VERIFIERS
from resispec.verify.auto import AutoPolicy, confidence_feature
from resispec.verify.estimate import per_node_alpha

Tensor = torch.Tensor
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


def auto_alpha(
    per_node: dict[str, dict], feature: Tensor, threshold: float, distinct_rule: str, iid_rule: str, n: int
):
    """resispec_auto's per-node α is its branch's per-node α: distinct where feature >= threshold (max q), never at
    n = 1 (AutoPolicy.distinct_rows)."""
    mask = (feature >= threshold) & (n > 1)
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
                        auto_alpha(results[k]["per_node"], results[k]["feature"], t, rule, iid_rule, n)[
                            0
                        ].mean()
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


def _logged_splits(cfg: HeadroomConfig, target, draft, tokenizer, splits) -> dict:
    """split -> (target logits, draft logits) at the positions sampled from the calibration and eval splits."""
    logged = {}
    for split, num in (
        (cfg.calibration_split, cfg.calibration_positions or cfg.positions),
        (cfg.eval_split, cfg.positions),
    ):
        wins = token_windows(
            tokenizer, splits[split], math.ceil(num / cfg.per_window), cfg.window, cfg.min_context
        )
        lt, ld = collect_logits(target, draft, wins, cfg.per_window, cfg.min_context, cfg.seed)
        logged[split] = (lt[:num], ld[:num])
    return logged


def _summaries(test: dict, policy: AutoPolicy) -> tuple[dict, dict]:
    """(summary per "n=..,T=..", the share of nodes the policy sends to the distinct rule): each rule's measured
    alpha, plus resispec_auto's (per node, by the calibrated policy) and the per-node oracle max."""
    summary, branch_share = {}, {}
    for (t, n), r in test.items():
        per_node = dict(r["per_node"])
        a, se, mask = auto_alpha(
            per_node, r["feature"], policy.threshold_for(n), policy.distinct_rule_for(n), policy.iid_rule, n
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
    return summary, branch_share


def run(
    cfg: HeadroomConfig,
    target_cfg: ModelConfig,
    draft_cfg: ModelConfig,
    world: WorldConfig,
    out_dir: str | Path,
    command: str = "python bench/headroom.py",
) -> dict:
    """Steps 1-4 of the module docstring for the (target, draft) pair; writes the report into `out_dir`."""
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target, draft, tokenizer = load_pair(target_cfg, draft_cfg, world)
    target.eval()
    draft.eval()
    splits = stdlib_splits(world)
    rules = cfg.rules or [r for r in sorted(VERIFIERS) if r != AUTO and not VERIFIERS[r].greedy_only]
    rules = [r for r in rules if r != AUTO]
    temperatures, draws = list(cfg.temperatures), list(cfg.draws)
    logged = _logged_splits(cfg, target, draft, tokenizer, splits)
    candidates = [c for c in cfg.candidates if c in rules]
    calib_rules = [r for r in rules if r == "resispec" or r in candidates]
    t0 = time.time()
    with tqdm(total=2 * len(temperatures) * len(draws), desc="alpha per rule") as bar:
        calib = evaluate_split(
            *logged[cfg.calibration_split],
            temperatures,
            draws,
            calib_rules,
            cfg.samples,
            cfg.seed,
            bar,
            False,
        )
        test = evaluate_split(
            *logged[cfg.eval_split], temperatures, draws, rules, cfg.samples, cfg.seed + 1, bar
        )
    policy = calibrate_policy(calib, draws, candidates=tuple(candidates))
    summary, branch_share = _summaries(test, policy)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(summary, rules, temperatures, draws)
    report = {
        "command": command,
        "world": world.name,
        "target": target_cfg.path,
        "draft": draft_cfg.path,
        "positions": {s: int(v[0].shape[0]) for s, v in logged.items()},
        "vocab": int(logged[cfg.eval_split][0].shape[-1]),
        "samples_per_node": cfg.samples,
        "calibration_split": cfg.calibration_split,
        "eval_split": cfg.eval_split,
        "policy": asdict(policy),
        "distinct_share": branch_share,
        "summary": summary,
        "seconds": round(time.time() - t0, 1),
    }
    (out_dir / "headroom.json").write_text(json.dumps(report, indent=2) + "\n")
    policy.save(out_dir / "auto_policy.json")
    header = (
        f"Per-node acceptance α on the {cfg.eval_split} split ({report['positions'][cfg.eval_split]} positions, "
        f"{world.name} world, V = {report['vocab']}); ± = Monte Carlo standard error of the mean "
        f"({cfg.samples} runs per node). resispec_auto policy calibrated on {cfg.calibration_split}: "
        f"distinct rule per n {dict((n, policy.distinct_rule_for(n)) for n in draws)}, max-q thresholds {policy.thresholds}.\n\n"
        f"Command: `{command}`\n\n"
    )
    (out_dir / "headroom.md").write_text(header + table + "\n")
    plot(summary, rules, temperatures, draws, out_dir / "headroom.png")
    print(header + table)
    print(f"wrote {out_dir}/headroom.md, headroom.json, headroom.png, auto_policy.json")
    return report
