"""Held-out evaluation that decides checkpoints: per-node acceptance alpha and the simulated accepted length tau.

Along target-generated held-out sequences (prompt + regenerated response), at every response position we take
p (target) and q (draft) after the decode processing and compute, for every rule of resispec.verify with a
closed-form acceptance (its `surrogate_acceptance`), alpha_rule(p, q, n) for each branching n of the configured tree.

Simulated tau. A tree with branching [n_0, ..., n_{D-1}] starting at response position s emits the accepted path
plus one bonus/correction token. If the tree's path follows the sequence, its depth-d node sits at position
s + d and is accepted with probability a_d(s) = alpha(p_{s+d}, q_{s+d}, n_d). Depth d+1 is reached only if
depths 0..d were all accepted, so the expected tokens per target forward is

    tau(s) = 1 + sum_{k=1}^{D} prod_{d<k} a_d(s),

and we report the mean over every start s whose whole window lies inside a response. Two simplifications,
both shared by all rules and checkpoints (so they rank them fairly): the accepted token at depth d is taken to be
the sequence's own token (a sample of p, whereas the accepted one is p conditioned on being a child), and each
node's children are i.i.d. of the position's q, ignoring siblings. Per-depth acceptance is the mean of a_d(s).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tqdm.auto import tqdm

from resispec.decoding.config import DecodeConfig
from resispec.losses import acceptance, fkl
from resispec.sampling import log_probs
from resispec.verify import VERIFIERS, build_rule, covers

Tensor = torch.Tensor


def closed_form_rules(ns: list[int] | tuple[int, ...] = (1, 2, 4)) -> list[str]:
    """Rules of resispec.verify whose training value (`surrogate_acceptance`: the closed form, or resispec_auto's
    closed-form stand-in) is declared for every n in `ns` (not rsd and gumbel; not `greedy`, exact only at
    temperature 0)."""
    return [
        name
        for name, rule in VERIFIERS.items()
        if not rule.greedy_only and all(covers(rule.surrogate_draws, int(n)) for n in ns)
    ]


def eval_rule(rule: str) -> str:
    """The rule whose simulated tau picks checkpoints: the decode rule itself (scored by its surrogate)."""
    return rule


def simulate_tau(alpha_by_depth: list[Tensor], lengths: list[int]) -> tuple[float, list[float]]:
    """Mean simulated tau and per-depth acceptance over all full windows (see module docstring).
    alpha_by_depth[d]: [N] acceptance at depth d's branching for every position, sequences concatenated;
    lengths: number of positions of each sequence (they sum to N)."""
    depth = len(alpha_by_depth)
    taus: list[Tensor] = []
    per_depth: list[list[Tensor]] = [[] for _ in range(depth)]
    start = 0
    for length in lengths:
        num_windows = length - depth + 1
        if num_windows > 0:
            reach = torch.ones(num_windows, dtype=torch.float64)  # P(depth d reached), [S]
            tau = torch.ones(num_windows, dtype=torch.float64)
            for d in range(depth):
                a = alpha_by_depth[d][start + d : start + d + num_windows].double()  # [S]
                per_depth[d].append(a)
                reach = reach * a
                tau = tau + reach
            taus.append(tau)
        start += length
    if not taus:
        return float("nan"), [float("nan")] * depth
    return torch.cat(taus).mean().item(), [torch.cat(a).mean().item() for a in per_depth]


def select_positions(
    rows: Iterable[tuple[list[int], list[int]]], max_positions: int
) -> list[tuple[Tensor, int]]:
    """(prompt_ids, response_ids) rows -> [(ids [L], num_prompt)] until max_positions response positions."""
    out, total = [], 0
    for prompt, response in rows:
        if len(response) == 0 or total >= max_positions:
            continue
        response = list(response)[: max_positions - total]
        ids = torch.tensor(list(prompt) + response, dtype=torch.long)
        out.append((ids, len(prompt)))
        total += len(response)
    return out


@torch.no_grad()
def _response_logprobs(model, ids: Tensor, num_prompt: int, decode: DecodeConfig, device) -> Tensor:
    """log probs [R, V] (after the decode processing) at the positions predicting the R response tokens."""
    x = ids.to(device)[None]  # [1, L]
    logits = model(input_ids=x).logits[0, num_prompt - 1 : x.shape[1] - 1]  # logits at t predict token t + 1
    return log_probs(logits, decode.temperature, decode.top_k, decode.top_p)


def shard_sequences(sequences: list, rank: int, num_processes: int) -> tuple[list, int]:
    """(this process's share of the held-out sequences, how many of them are padding): every process gets the
    same number of sequences, because a sharded draft's forward (FSDP, ZeRO-3) is collective; the padding repeats
    a sequence and its results are dropped."""
    mine = list(sequences[rank::num_processes])
    pad = -(-len(sequences) // num_processes) - len(mine)
    return mine + [sequences[0]] * pad, pad


@torch.no_grad()
def target_eval_logprobs(
    target, sequences: list[tuple[Tensor, int]], decode: DecodeConfig, show_progress: bool = False
) -> list[Tensor]:
    """The target's processed log probs [R, V] of each held-out sequence, on the CPU in float32: evaluation
    without a resident target (train.target_signal=cached), identical to the online evaluation."""
    device = next(target.parameters()).device
    return [
        _response_logprobs(target, ids, n, decode, device).float().cpu()
        for ids, n in tqdm(sequences, desc="held-out target", disable=not show_progress, leave=False)
    ]


@torch.no_grad()
def evaluate(
    target: torch.nn.Module | None,
    draft: torch.nn.Module,
    sequences: list[tuple[Tensor, int]],  # from select_positions
    decode: DecodeConfig,
    rules: list[str] | None = None,
    chunk: int = 256,
    show_progress: bool = False,
    target_logprobs: list[Tensor] | None = None,
) -> dict:
    """Held-out alpha per rule and n, per-depth acceptance, simulated tau per rule, and mean fkl.
    Returns {"num_positions", "fkl", "alpha": {rule: {n: a}}, "per_depth": {rule: [a_d]}, "tau": {rule: t}}.

    target_logprobs: the target's side precomputed (`target_eval_logprobs`, one per sequence) instead of
    `target`. Split over processes: `evaluate_sharded`."""
    rules = closed_form_rules(sorted(set(int(n) for n in decode.fixed_tree))) if rules is None else rules
    parts = _evaluate_part(target, draft, sequences, decode, rules, chunk, show_progress, target_logprobs)
    return _summarise(parts, decode, rules)


@torch.no_grad()
def evaluate_sharded(
    accelerator,
    target: torch.nn.Module | None,
    draft: torch.nn.Module,
    sequences: list[tuple[Tensor, int]],
    decode: DecodeConfig,
    rules: list[str] | None = None,
    show_progress: bool = False,
    target_logprobs: list[Tensor] | None = None,
) -> dict:
    """`evaluate` with the sequences split over the processes (each runs its `shard_sequences` share; the results
    are gathered, so every process returns the same metrics as one process over all of them, up to float
    summation order). target_logprobs: this process's share, as `target_eval_logprobs` of its shard."""
    rules = closed_form_rules(sorted(set(int(n) for n in decode.fixed_tree))) if rules is None else rules
    if accelerator is None or accelerator.num_processes == 1:
        return evaluate(
            target,
            draft,
            sequences,
            decode,
            rules,
            show_progress=show_progress,
            target_logprobs=target_logprobs,
        )
    mine, pad = shard_sequences(sequences, accelerator.process_index, accelerator.num_processes)
    part = _evaluate_part(target, draft, mine, decode, rules, 256, show_progress, target_logprobs)
    part = _drop_last(part, pad)
    gathered = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(gathered, part)
    merged = {
        "lengths": [n for g in gathered for n in g["lengths"]],
        "fkl": [t for g in gathered for t in g["fkl"]],
        "alpha": {
            r: {n: [t for g in gathered for t in g["alpha"][r][n]] for n in part["alpha"][r]} for r in rules
        },
    }
    return _summarise(merged, decode, rules)


def _drop_last(part: dict, pad: int) -> dict:
    """The results of all but the last `pad` sequences (the padding of `shard_sequences`)."""
    if pad == 0:
        return part
    keep = len(part["lengths"]) - pad
    return {
        "lengths": part["lengths"][:keep],
        "fkl": part["fkl"][:keep],
        "alpha": {r: {n: v[:keep] for n, v in by_n.items()} for r, by_n in part["alpha"].items()},
    }


def _evaluate_part(target, draft, sequences, decode, rules, chunk, show_progress, target_logprobs) -> dict:
    """Per sequence: its number of positions, fkl [R] and alpha [R] per rule and n (on the CPU)."""
    was_training = draft.training
    draft.eval()
    device = next(draft.parameters()).device
    ns = sorted(set(int(n) for n in decode.fixed_tree))
    alphas: dict[str, dict[int, list[Tensor]]] = {r: {n: [] for n in ns} for r in rules}
    rule_objs = {r: build_rule(r, decode.auto_policy) for r in rules}
    fkls, lengths = [], []
    for i, (ids, num_prompt) in enumerate(
        tqdm(sequences, desc="held-out alpha", disable=not show_progress, leave=False)
    ):
        if target_logprobs is not None:
            log_p = target_logprobs[i].to(device)
        else:
            log_p = _response_logprobs(target, ids, num_prompt, decode, device)  # [R, V]
        log_q = _response_logprobs(draft, ids, num_prompt, decode, device)
        lengths.append(log_p.shape[0])
        fkls.append(fkl(log_p, log_q).cpu())
        per = {r: {n: [] for n in ns} for r in rules}
        for s in range(0, log_p.shape[0], chunk):  # bound the rules' [chunk, V] temporaries
            p, q = log_p[s : s + chunk].exp(), log_q[s : s + chunk].exp()
            for r in rules:
                for n in ns:
                    per[r][n].append(acceptance(rule_objs[r], p, q, n).float().cpu())
        for r in rules:
            for n in ns:
                alphas[r][n].append(torch.cat(per[r][n]) if per[r][n] else torch.zeros(0))
    draft.train(was_training)
    return {"lengths": lengths, "fkl": fkls, "alpha": alphas}


def _summarise(parts: dict, decode: DecodeConfig, rules: list[str]) -> dict:
    """The metrics of `evaluate` from per-sequence results (`_evaluate_part`, possibly gathered)."""
    tree = [int(n) for n in decode.fixed_tree]
    ns = sorted(set(tree))
    lengths, fkls, alphas = parts["lengths"], parts["fkl"], parts["alpha"]
    out: dict = {
        "num_positions": int(sum(lengths)),
        "fkl": torch.cat(fkls).mean().item() if fkls else float("nan"),
    }
    out["alpha"], out["per_depth"], out["tau"] = {}, {}, {}
    for r in rules:
        by_n = {n: torch.cat(alphas[r][n]) if alphas[r][n] else torch.zeros(0) for n in ns}
        out["alpha"][r] = {str(n): by_n[n].mean().item() for n in ns}
        out["tau"][r], out["per_depth"][r] = simulate_tau([by_n[n] for n in tree], lengths)
    return out


def format_metrics(metrics: dict) -> str:
    """A markdown table of held-out alpha (per n) and simulated tau per rule, before vs after."""
    before, after = metrics.get("before") or {}, metrics.get("after") or {}
    rules = list((before or after).get("tau", {}))
    ns = list(next(iter((before or after).get("alpha", {}).values()), {}))
    head = ["rule"] + [f"alpha n={n} before/after" for n in ns] + ["tau before", "tau after"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def get(m: dict, *keys) -> str:
        for k in keys:
            if not isinstance(m, dict) or k not in m:
                return "-"
            m = m[k]
        return f"{m:.3f}"

    for r in rules:
        cells = [r] + [f"{get(before, 'alpha', r, n)} / {get(after, 'alpha', r, n)}" for n in ns]
        cells += [get(before, "tau", r), get(after, "tau", r)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        f"held-out positions: {before.get('num_positions', '-')}; fkl before {get(before, 'fkl')}, "
        f"after {get(after, 'fkl')}; best step {metrics.get('best_step')} by tau of {metrics.get('rule')}"
    )
    return "\n".join(lines)
