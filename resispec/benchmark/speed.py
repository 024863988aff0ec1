"""The end-to-end benchmark: AR vs each rule x tree shape (per draft; at temperature 0, where every rule is argmax
matching, each tree once: rules_at), and HF assisted generation, same prompts.

Every method runs on the same held-out prompts with the same per-prompt seeds, after untimed warm-up. A row reports
tokens/s (generated tokens / wall-clock seconds summed over prompts), tau, per-depth acceptance, c (mean draft
forward time / mean target forward time) and the speedup over the AR row of the same temperature and run.

`run_bench(...)` (typed configs, used by `bench/speed.py` and the pipeline) loads what it needs and returns the
rows; `bench_pair(...)` measures already-loaded models; `report.write_report(...)` writes report.md, report.json and
speedup.png. This is the one speed harness: tau and c come from DecodeStats. `bench.random_pair=true` times a
random-weight pair shaped like the tiny world instead (no built world needed; speed only).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from resispec.benchmark import vllm_peer
from resispec.benchmark.config import BenchConfig
from resispec.benchmark.report import best_fixed_of, best_lines, log_wandb, print_table, write_report
from resispec.benchmark.results import BenchRow, Method, sum_stats, tree_of, tree_str
from resispec.data.prompts import load_heldout_prompts
from resispec.decoding import DecodeStats, SpeculativeDecoder
from resispec.decoding.config import DecodeConfig
from resispec.decoding.planner import (
    CostModel,
    Planner,
    calibrate_alpha,
    expected_tau,
    greedy_continuations,
    greedy_hit_sets,
    greedy_tau,
    sampled_continuations,
    teacher_forced_logits,
)
from resispec.models import load_pair
from resispec.models.config import ModelConfig
from resispec.models.head import is_head
from resispec.models.loading import check_same_tokenizer, load_drafter, load_tokenizer, resolve_device
from resispec.sampling import is_greedy
from resispec.verify import build_rule

log = logging.getLogger(__name__)


def _seeded(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decoder_method(row: BenchRow, fn, device, sampling: dict) -> Method:
    def run(p: list[int], seed: int, max_new_tokens: int):
        ids = torch.tensor([p], device=device)  # [1, L]
        out = fn(ids, generator=_seeded(seed, device), **{**sampling, "max_new_tokens": max_new_tokens})
        return out.sequences.shape[1] - len(p), out.stats

    return Method(row, run)


def _hf_method(row: BenchRow, target, draft, device, sampling: dict, k: int, pad_id) -> Method:
    """HF `generate(assistant_model=draft)` drafting a constant chain of k tokens.

    transformers reads the drafting settings from the ASSISTANT's generation_config (not from generate kwargs), so
    they are set there for the call and restored after; the confidence cut-off is off, so every step drafts k."""
    temperature = sampling["temperature"]
    kwargs: dict[str, Any] = dict(
        assistant_model=draft,
        do_sample=temperature > 0,
        pad_token_id=pad_id,
        eos_token_id=sampling["eos_token_id"],
    )
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=sampling["top_p"], top_k=sampling["top_k"])
    drafting = dict(
        num_assistant_tokens=k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0
    )

    def run(p: list[int], seed: int, max_new_tokens: int):
        gc = draft.generation_config
        saved = {name: getattr(gc, name, None) for name in drafting}
        for name, value in drafting.items():
            setattr(gc, name, value)
        try:
            torch.manual_seed(seed)
            ids = torch.tensor([p], device=device)  # [1, L]
            out = target.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kwargs
            )
        finally:
            for name, value in saved.items():
                setattr(gc, name, value)
        return out.shape[1] - len(p), None

    return Method(row, run)


def hf_chain_lengths(bench: BenchConfig) -> list[int]:
    """Chain lengths tried for HF assisted generation (the best is the fair peer)."""
    if bench.hf_num_assistant_tokens:
        return sorted(set(bench.hf_num_assistant_tokens))
    return sorted({len(t) for t in bench.trees})


def rules_at(temperature: float, rules: list[str]) -> list[str]:
    """The rules timed at `temperature`: `rules`, except at temperature 0, where every exact rule reduces to argmax
    matching over the draft's top-b (resispec/verify/greedy.py) and the decoder runs that, walk.GREEDY, whatever its
    rule: each rule's row would be the same decode, timed again, and the fastest of them the luckiest. There, one row
    a tree (and one plan a draft), rule "greedy" (none where `rules` is empty)."""
    return ["greedy"] if rules and is_greedy(temperature) else list(rules)


def _methods(
    target,
    drafts: dict[str, Any],
    tokenizer,
    bench: BenchConfig,
    decode: DecodeConfig,
    temperature: float,
    sampling: dict,
    plan: Planner | None = None,
) -> list[Method]:
    """AR first (the baseline), then every (draft, rule, tree), the planner's tree per rule in bench.plan_rules,
    then HF assisted per draft and chain length; at temperature 0 one rule, "greedy" (rules_at)."""

    device = next(target.parameters()).device
    first_draft = next(iter(drafts.values()))
    fast = decode.fast_forward
    ar_dec = SpeculativeDecoder(
        target, first_draft, rule="chain", tree=[1], tokenizer=tokenizer, fast_forward=fast
    )
    out = [_decoder_method(BenchRow("ar", temperature), ar_dec.generate_autoregressive, device, sampling)]
    if bench.reference_step:  # the reference decoder's own baseline: AR on the HF forward
        ar_ref = SpeculativeDecoder(
            target, first_draft, rule="chain", tree=[1], tokenizer=tokenizer, fast_forward=False
        )
        row = BenchRow("ar_ref", temperature, tree="HF forward")
        out.append(_decoder_method(row, ar_ref.generate_autoregressive, device, sampling))
    for label, draft in drafts.items():
        for rule in rules_at(temperature, bench.draft_rules.get(label, bench.rules)):
            for tree in bench.trees:
                dec = SpeculativeDecoder(
                    target,
                    draft,
                    rule=build_rule(rule, decode.auto_policy),
                    tree=tree,
                    tokenizer=tokenizer,
                    compile=decode.compile,
                    fast_forward=fast,
                )
                row = BenchRow("spec", temperature, draft=label, rule=rule, tree=tree_str(tree))
                out.append(_decoder_method(row, dec.generate, device, sampling))
                if bench.reference_step:
                    ref = SpeculativeDecoder(  # the step on the HF forward (the reference step: tests/oracle_decoder.py)
                        target,
                        draft,
                        rule=dec.rule,
                        tree=tree,
                        tokenizer=tokenizer,
                        fast_forward=False,
                    )
                    row = BenchRow("spec", temperature, draft=label, rule=rule, tree="ref" + tree_str(tree))
                    out.append(_decoder_method(row, ref.generate, device, sampling))
        # a draft head is planned by decoding only (Planner._settle_head: no cost or acceptance model)
        for rule in rules_at(temperature, bench.plan_rules) if plan is not None else ():
            chosen = plan.choose(draft, rule, sampling, decode.auto_policy)
            log.info("T=%g %s %s: %s (alpha %s)", temperature, label, rule, chosen.describe(), chosen.alpha)
            print(f"planner T={temperature:g} {label} {rule}: {chosen.describe()}")
            dec = SpeculativeDecoder(
                target,
                draft,
                rule=build_rule(rule, decode.auto_policy),
                tree=chosen.tree,
                tokenizer=tokenizer,
                compile=decode.compile,
                fast_forward=fast,
            )
            row = BenchRow("spec", temperature, draft=label, rule=rule, tree="auto" + tree_str(chosen.tree))
            row.stats["plan"] = chosen.as_dict()
            out.append(_decoder_method(row, dec.generate, device, sampling))
        if bench.hf_assisted and not is_head(draft):  # HF assisted generation takes a causal LM
            for k in hf_chain_lengths(bench):
                row = BenchRow("hf_assisted", temperature, draft=label, rule="hf", tree=f"chain {k}")
                out.append(_hf_method(row, target, draft, device, sampling, k, tokenizer.pad_token_id))
    if bench.vllm:  # vLLM peer rows, interleaved with ours
        out += vllm_peer.bench_methods(target, drafts, tokenizer, bench, temperature, sampling)
    return out


def round_prompts(prompts: list[list[int]], rounds: int) -> list[list[tuple[int, list[int]]]]:
    """The bench's prompts split into `rounds` consecutive blocks, one per round (run_bench loads bench.num_prompts
    per round), each prompt with its index (its seed: bench.seed + index); at most one round per prompt."""
    per = math.ceil(len(prompts) / max(1, min(rounds, len(prompts))))
    indexed = list(enumerate(prompts))
    return [indexed[i : i + per] for i in range(0, len(indexed), per)]


def _timed(m: Method, prompt: list[int], seed: int, bench: BenchConfig, device) -> tuple[float, int, Any]:
    """One timed call of a method: (seconds, new tokens, DecodeStats | None)."""
    _sync(device)
    t0 = time.perf_counter()
    num, stats = m.run(prompt, seed, bench.max_new_tokens)
    _sync(device)
    return time.perf_counter() - t0, num, stats


def time_methods(
    methods: list[Method], prompts: list[list[int]], bench: BenchConfig, temperature: float, device, bar
) -> None:
    """Untimed short warm-up of every method, then `bench.rounds` rounds (round_prompts: each its own prompts),
    each prompt of a round through every method in turn (the same seed for every method), the method order reversed
    every other round (ABBA: a drift of the machine's speed during a prompt's sweep weighs on the first and the
    last methods alike), adding each call's seconds, tokens and DecodeStats to its Method and to its round."""
    for m in methods:  # warm-up: untimed, short
        for w in range(bench.warmup):
            bar.set_postfix_str(f"T={temperature:g} warm-up {m.row.label}")
            m.run(prompts[w % len(prompts)], bench.seed + 10_000 + w, 8)
            bar.update()
    rounds = round_prompts(prompts, bench.rounds)
    for rnd, block in enumerate(rounds):
        order = methods if rnd % 2 == 0 else methods[::-1]
        for m in methods:
            m.round_seconds.append(0.0)
            m.round_tokens.append(0)
        for i, p in block:
            for m in order:
                where = f"round {rnd + 1}/{len(rounds)} " if len(rounds) > 1 else ""
                bar.set_postfix_str(f"T={temperature:g} {where}prompt {i + 1}/{len(prompts)} {m.row.label}")
                # the same seed for every method
                seconds, num, stats = _timed(m, p, bench.seed + i, bench, device)
                m.seconds += seconds
                m.tokens += num
                m.round_seconds[-1] += seconds
                m.round_tokens[-1] += num
                if stats is not None:
                    m.stats.append(stats)
                bar.update()


def time_fastest(
    group: list[Method],
    block: list[tuple[int, list[int]]],
    repeats: int,
    bench: BenchConfig,
    device,
    bar,
    what: str,
) -> tuple[dict[int, float], dict[int, float | None]]:
    """`repeats` passes over `block` (round_prompts' (index, prompt) pairs, each with the sweep's seed), each prompt
    through every method of `group` in turn, the order reversed every other prompt and pass; each (method, prompt)
    counts at its fastest call. Returns id(method) -> tokens/s (all tokens / the fastest calls' seconds), and
    id(method) -> the tau those calls decoded (None: a method without DecodeStats; a seeded call decodes the same
    tokens every pass)."""
    bar.total += len(group) * len(block) * repeats
    fastest = {id(m): [math.inf] * len(block) for m in group}
    tokens = {id(m): [0] * len(block) for m in group}
    stats: dict[int, list] = {id(m): [None] * len(block) for m in group}
    for rep in range(repeats):
        for j, (i, p) in enumerate(block):
            for m in group if (rep + j) % 2 == 0 else group[::-1]:
                bar.set_postfix_str(f"{what} {rep + 1}/{repeats} prompt {j + 1}/{len(block)} {m.row.label}")
                seconds, num, call_stats = _timed(m, p, bench.seed + i, bench, device)
                if seconds < fastest[id(m)][j]:
                    fastest[id(m)][j], stats[id(m)][j] = seconds, call_stats
                tokens[id(m)][j] = num
                bar.update()
    taus = {k: None if None in v else sum_stats(v).tau for k, v in stats.items()}
    return {k: sum(tokens[k]) / sum(fastest[k]) for k in fastest}, taus


def confirm_plans(
    methods: list[Method], prompts: list[list[int]], bench: BenchConfig, temperature: float, device, bar
) -> None:
    """The tree=auto head-to-head, after fill_rows (bench.plan_confirm_repeats > 0): AR, every planned row and the
    best fixed row of its draft and rule (picked by the sweep's speedup; none to re-time where that is the planned
    tree itself) timed again on the first round's prompts (or the first bench.plan_confirm_prompts), each prompt
    through all of them in turn (the order reversed every other prompt and repeat), each (method, prompt) counted at
    its fastest of the repeats. The sweep picks the best fixed row and this measures it afresh, so the luck that made
    it the sweep's fastest does not count against the plan. The machine's noise stays: two identical decodes timed
    this way read up to 8% apart at 6 prompts x 2, within 5% at 12 x 3 (bench/experiments/h2h_noise.py,
    docs/decoder_speed.md). Each planned row gets stats["head_to_head"]: its speedup over AR, the best fixed row's,
    their ratio, and the tau each one's counted calls decoded (check_plans_on_pool carries by it)."""
    repeats = bench.plan_confirm_repeats
    planned = [m for m in methods if m.row.stats.get("plan")]
    if repeats <= 0 or not planned:
        return
    rows = [m.row for m in methods]
    method_of = {id(m.row): m for m in methods}
    best: dict[int, BenchRow | None] = {}  # planned method -> the sweep's best fixed row of its rule
    group = [methods[0]]  # AR: the yardstick
    for m in planned:
        best[id(m)] = b = best_fixed_of(rows, m.row)
        for g in [m] if b is None or m.row.tree == "auto" + b.tree else [m, method_of[id(b)]]:
            if all(g is not x for x in group):
                group.append(g)
    block = list(enumerate(prompts))[: bench.plan_confirm_prompts] or round_prompts(prompts, bench.rounds)[0]
    tps, taus = time_fastest(group, block, repeats, bench, device, bar, f"T={temperature:g} head-to-head")

    def speedup(m: Method) -> float:
        return tps[id(m)] / tps[id(methods[0])]

    for m in planned:
        h = {"speedup": speedup(m), "tau": taus[id(m)], "prompts": len(block), "repeats": repeats}
        if (b := best[id(m)]) is not None:
            same = m.row.tree == "auto" + b.tree  # the same decode: one measure serves both
            b_m = m if same else method_of[id(b)]
            h.update(best_fixed=b.tree, best_speedup=speedup(b_m), best_tau=taus[id(b_m)], same_tree=same)
            h["ratio"] = h["speedup"] / h["best_speedup"]
        m.row.stats["head_to_head"] = h


# check_plans_on_pool at T > 0: the tokens of each pool prompt's sampled continuation that calibrate alpha (the
# planner's continuation_tokens) and their seeds
POOL_SAMPLED_TOKENS, POOL_SEED = 32, 30_000


def _carried(
    tree: list[int], speedup: float, tau_of, timed: int, tau_decoded: float | None = None
) -> dict | None:
    """`tree`'s tau over every pool prompt and over the first `timed` (those its `speedup` was timed on), `tau_of(tree,
    prompts)` (None: not counted), and that speedup carried to the former: x pool tau / the tau the timed calls
    decoded (`tau_decoded`; None: the count on their prompts). At T = 0 the two are one (the count is the decoder's
    own); at T > 0 the decoded one also holds the luck of the calls' draws, which the count, an expectation, does
    not (run AY: a chain [1]*5 decoded tau 2.85 on the sweep's 12 prompts, the model counting 3.08)."""
    tau, tau_timed = tau_of(tree, None), tau_of(tree, timed)
    if tau is None or tau_timed is None:
        return None
    decoded = tau_decoded or tau_timed
    return {"tau": tau, "tau_timed": tau_timed, "tau_decoded": decoded, "speedup": speedup * tau / decoded}


def _pool_tau_of(target, draft, rule, pool, settings: dict, continuations, per_draft: list):
    """tau_of(tree, k) over the first k pool prompts (None: all) for _carried. T = 0: greedy_tau, the decoder's own
    count, any tree (`per_draft`: the draft's greedy_hit_sets along greedy_continuations'). T > 0: the product
    model of a chain (its expectation: one draw a level) with alpha(1) of `rule` averaged over those prompts'
    sampled continuations (`continuations`: sampled_continuations'; `per_draft`: their node logits, one (target,
    draft) pair a prompt, as node_logits gives them), as the planner calibrates it; a tree with a multi-draw level gets None."""
    if is_greedy(settings["temperature"]):
        return lambda tree, k: greedy_tau(tree, per_draft[:k])
    alphas = [
        calibrate_alpha(target, draft, [seq], rule, settings, start=len(p), max_draws=1, logits=lg)[1]
        for p, seq, lg in zip(pool, continuations, per_draft, strict=True)
    ]

    def tau_of(tree: list[int], k: int | None) -> float | None:
        some = alphas[:k]
        return expected_tau(tree, {1: sum(some) / len(some)}) if set(tree) == {1} else None

    return tau_of


def _pool_counters(
    target, drafts: dict[str, Any], rows: list[BenchRow], pool, sampling: dict, auto_policy
) -> dict:
    """(draft label, rule) -> _pool_tau_of's tau_of, for each planned row in `rows`: the continuations and, at
    T > 0, the target's node logits over them once for all (batched teacher-forced forwards), each draft's forwards
    (T = 0 its greedy hit sets, T > 0 its node logits) once for every rule."""
    settings = {k: sampling[k] for k in ("temperature", "top_k", "top_p")}
    greedy = is_greedy(settings["temperature"])
    starts = [len(p) for p in pool]
    if greedy:
        continuations = greedy_continuations(target, pool, sampling["max_new_tokens"])
    else:
        continuations = sampled_continuations(target, pool, POOL_SAMPLED_TOKENS, settings, POOL_SEED)
        target_logits = teacher_forced_logits(target, continuations, starts, target.config.vocab_size)
    counters: dict[tuple[str, str], Any] = {}
    per_draft: dict[str, list] = {}
    for r in rows:
        if (r.draft, r.rule) in counters:
            continue
        draft = drafts[r.draft]
        if r.draft not in per_draft and greedy:
            per_draft[r.draft] = greedy_hit_sets(target, draft, pool, continuations)
        elif r.draft not in per_draft:  # one (target, draft) pair a prompt, over the vocabulary they share
            vocab = min(target.config.vocab_size, draft.config.vocab_size)
            draft_logits = teacher_forced_logits(draft, continuations, starts, vocab)
            pairs = zip(target_logits, draft_logits, strict=True)
            per_draft[r.draft] = [(t[:, :vocab], d) for t, d in pairs]
        rule = build_rule(r.rule, auto_policy)
        counters[r.draft, r.rule] = _pool_tau_of(
            target, draft, rule, pool, settings, continuations, per_draft[r.draft]
        )
    return counters


def check_plans_on_pool(
    methods: list[Method],
    prompts: list[list[int]],
    pool: list[list[int]],
    target,
    drafts: dict[str, Any],
    sampling: dict,
    auto_policy=None,
) -> None:
    """After confirm_plans (bench.plan_check_prompts > 0): each planned row's tree and the best fixed row of its rule
    counted on `pool` (the bench's prompts first, then more test prompts), and each timed speedup (the
    head-to-head's, else the sweep's) carried to the pool's tau: speedup x pool tau / the tau its calls decoded (a
    decode of fixed length takes steps as 1 / tau; _carried). A speedup's prompts sample a wide spread (the tiny
    world's greedy chain tau: 0.6 a prompt around 2.8) and the bench times few, so the plan, its prediction and the
    best fixed row compare here on many. T = 0: every tree, by greedy replay (exact: the decoder's own count, EOS
    ignored; no decode). T > 0: chains, by the product model (_pool_tau_of); a tree with a multi-draw level is not
    carried. Each planned row of a causal-LM draft gets stats["pool"]."""
    planned = [m for m in methods if m.row.stats.get("plan") and not is_head(drafts[m.row.draft])]
    if not planned or len(pool) <= len(prompts):
        return
    counters = _pool_counters(target, drafts, [m.row for m in planned], pool, sampling, auto_policy)
    rows = [m.row for m in methods]
    for m in planned:
        r = m.row
        tau_of = counters[r.draft, r.rule]
        h2h = r.stats.get("head_to_head")
        timed = h2h["prompts"] if h2h else len(prompts)  # the first prompts, in both
        speedup, decoded = (h2h["speedup"], h2h.get("tau")) if h2h else (r.speedup, r.tau)
        out = {"prompts": len(pool), "timed_prompts": timed, "timed_by": "head-to-head" if h2h else "sweep"}
        out.update(_carried(tree_of(r.tree), speedup, tau_of, timed, decoded) or {})
        b = best_fixed_of(rows, r)
        best = None
        if b is not None:
            if h2h:
                b_speedup, b_decoded = h2h.get("best_speedup", speedup), h2h.get("best_tau")
            else:
                b_speedup, b_decoded = b.speedup, b.tau
            best = _carried(tree_of(b.tree), b_speedup, tau_of, timed, b_decoded)
            out["best_fixed"] = b.tree
        if best is not None:
            out.update({f"best_{k}": v for k, v in best.items()})
            if "speedup" in out:
                out["ratio"] = out["speedup"] / best["speedup"]
        r.stats["pool"] = out


def fill_rows(
    methods: list[Method], num_prompts: int, drafts: dict[str, Any], plan: Planner | None
) -> list[BenchRow]:
    """The timed methods' rows: tokens/s, speedup over the first method (AR), the summed counters (tau, per-depth
    acceptance, c) and each speculative row's per-step breakdown."""
    ar_tps = methods[0].tokens / methods[0].seconds
    rows = []
    for m in methods:
        r = m.row
        r.num_prompts, r.num_tokens, r.seconds = num_prompts, m.tokens, m.seconds
        r.tokens_per_second = m.tokens / m.seconds
        r.speedup = r.tokens_per_second / ar_tps
        if len(m.round_seconds) > 1:  # each round's own speedup over that round's AR: the run's noise, shown
            r.stats["round_speedups"] = [
                (n / s) / (ar_n / ar_s)
                for n, s, ar_n, ar_s in zip(
                    m.round_tokens,
                    m.round_seconds,
                    methods[0].round_tokens,
                    methods[0].round_seconds,
                    strict=True,
                )
            ]
        if m.stats:
            total_stats = sum_stats(m.stats)
            r.stats = {**r.stats, **total_stats.as_dict()}  # keeps the plan of a tree=auto row
            r.tau = total_stats.tau
            r.tau_stderr = total_stats.tau_stderr
            if r.method == "spec":
                r.per_depth_acceptance = total_stats.per_depth_acceptance
                r.c = total_stats.c
                head = is_head(drafts[r.draft])  # not in the planner's cost model (a causal LM's)
                cost = plan.cost_for(drafts[r.draft]) if plan is not None and not head else None
                r.stats["breakdown"] = step_breakdown(total_stats, 1e3 / ar_tps, cost, r.tree)
        rows.append(r)
    return rows


def bench_pair(
    target,
    drafts: dict[str, Any],
    tokenizer,
    prompts: list[list[int]],
    bench: BenchConfig,
    decode: DecodeConfig,
    progress: bool = True,
    calibration: list[list[int]] | None = None,
    pool: list[list[int]] | None = None,
) -> list[BenchRow]:
    """Measure AR, every (draft, rule, tree), the planned trees and HF assisted generation on `prompts` at each
    temperature. `calibration`: prompts for the planner (default: the bench prompts themselves). `pool`: `prompts`
    then more test prompts, on which check_plans_on_pool counts the plans' tau (None: no check).

    Methods are interleaved per prompt (prompt 1: every method, prompt 2: every method, ...), so a slow phase of
    a shared machine hits all methods alike and the speedups stay comparable."""
    if not prompts:
        raise ValueError("bench needs at least one prompt")
    device = next(target.parameters()).device
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    rows: list[BenchRow] = []
    # each temperature adds its methods' calls to the total
    bar = tqdm(total=0, desc="bench", disable=not progress, unit="gen")
    plan = Planner(target, calibration or prompts) if bench.plan_rules else None
    for temperature in bench.temperatures:
        sampling = dict(
            max_new_tokens=bench.max_new_tokens,
            temperature=temperature,
            top_p=decode.top_p,
            top_k=decode.top_k,
            eos_token_id=eos,
        )
        methods = _methods(target, drafts, tokenizer, bench, decode, temperature, sampling, plan)
        bar.total += len(methods) * (len(prompts) + bench.warmup)
        time_methods(methods, prompts, bench, temperature, device, bar)
        rows += fill_rows(methods, len(prompts), drafts, plan)
        confirm_plans(methods, prompts, bench, temperature, device, bar)
        if pool:
            bar.set_postfix_str(f"T={temperature:g} the plans' tau on {len(pool)} prompts")
            check_plans_on_pool(methods, prompts, pool, target, drafts, sampling, decode.auto_policy)
        if bench.vllm:
            vllm_peer.finish(methods, bench)
    bar.close()
    if plan is not None and rows:  # the measured cost model travels with the AR row into report.json
        rows[0].stats["cost_model"] = {
            label: {"target_ms": c.target_ms, "draft_ms": c.draft_ms}
            for label, c in plan.costs({k: d for k, d in drafts.items() if not is_head(d)}).items()
        }
        rows[0].stats["planner_init_s"] = plan.init_s
        rows[0].stats["planner_greedy_s"] = plan.greedy_s
    return rows


def step_breakdown(
    stats: DecodeStats, ar_token_ms: float, cost: CostModel | None = None, tree: str = ""
) -> dict:
    """Per-step milliseconds of a speculative row, all measured inside the steps of this run: the draft forwards,
    the rest of the draft phase (drafting: sampling the candidates, tree masks), the target forward (the verify
    phase), the accept walk, and the rest (cache compaction, bookkeeping). Host overhead = everything that is not
    a model forward, as a fraction of one AR token's time measured in the same run (a shared machine's speed
    drifts by tens of percent within minutes, so the yardstick is measured alongside) and of the row's own target
    forward (the decoder-speed issue's "one target forward").
    With `cost`, also the cost model's prediction of the two models' forward time for `tree`."""
    steps = max(stats.num_drafts, 1)
    step, draft, draft_fwd, target, accept = (
        1e3 * x / steps
        for x in (
            stats.total_seconds,
            stats.draft_seconds,
            stats.draft_forward_seconds,
            stats.target_seconds,
            stats.accept_seconds,
        )
    )
    overhead = step - draft_fwd - target
    out = {
        "step_ms": step,
        "draft_forward_ms": draft_fwd,
        "drafting_ms": draft - draft_fwd,
        "target_ms": target,
        "accept_ms": accept,
        "other_ms": step - draft - target - accept,
        "mean_nodes": 1 + stats.num_draft_tokens / steps,
        "overhead_ms": overhead,
        "ar_token_ms": ar_token_ms,
        "overhead_frac_of_ar_token": overhead / ar_token_ms,
        "overhead_frac_of_target": overhead / target if target > 0 else None,
    }
    if cost is not None and "[" in tree:
        shape = [
            int(b) for b in tree[tree.index("[") :].strip("[]").split(",")
        ]  # "[..]", "auto[..]", "ref[..]"
        out["predicted_forward_ms"] = CostModel(cost.target_ms, cost.draft_ms).step_ms(shape)
    return out


# a random-weight pair shaped like the tiny world (conf/world/tiny.yaml): vocab, widths, depths, heads
RANDOM_VOCAB = 8192
RANDOM_TARGET = dict(hidden=256, layers=12, heads=4)
RANDOM_DRAFT = dict(hidden=96, layers=1, heads=2)
RANDOM_PROMPT_LEN = 32


def random_pair(device: str | torch.device, seed: int = 0):
    """(target, draft, tokenizer stand-in): random Llamas shaped like the tiny world, no built world needed. For
    timing only: their tau says nothing about a trained pair."""

    def make(hidden: int, layers: int, heads: int, seed: int) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=RANDOM_VOCAB,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
        return LlamaForCausalLM(cfg).to(device).eval()

    target, draft = make(**RANDOM_TARGET, seed=seed), make(**RANDOM_DRAFT, seed=seed + 1)
    tokenizer = SimpleNamespace(eos_token_id=target.config.eos_token_id, pad_token_id=0)
    return target, draft, tokenizer


def random_prompts(num_prompts: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, RANDOM_VOCAB, (num_prompts, RANDOM_PROMPT_LEN), generator=gen).tolist()


def plan_prompts(
    bench: BenchConfig, data, tokenizer, world, prompts: list[list[int]]
) -> tuple[list[list[int]] | None, list[list[int]] | None]:
    """(the planner's calibration prompts, check_plans_on_pool's pool), None where unused: the planner calibrates on
    validation prompts, never on the prompts it is measured on; the pool is the bench's `prompts`, then more of the
    test split (bench.plan_check_prompts in all)."""
    if not bench.plan_rules or bench.random_pair or data is None or bench.plan_calibration_prompts <= 0:
        return None, None
    calibration = load_heldout_prompts(data, tokenizer, world, bench.plan_calibration_prompts, split="eval")
    if bench.plan_check_prompts <= len(prompts):
        return calibration, None
    more = load_heldout_prompts(data, tokenizer, world, bench.plan_check_prompts)
    return calibration, prompts + [p for p in more if p not in prompts][
        : bench.plan_check_prompts - len(prompts)
    ]


def run_bench(
    bench: BenchConfig,
    decode: DecodeConfig,
    target_cfg,
    draft_cfg,
    world=None,
    data=None,
    logger=None,
    output_dir: str | Path | None = None,
    run_name: str = "bench",
    prompts: list[list[int]] | None = None,
    progress: bool = True,
    show: bool = True,
) -> list[BenchRow]:
    """Load the pair (and any `bench.drafts`), measure every method, write the report, print the table, log W&B.

    prompts: token id lists; default: `bench.num_prompts` held-out prompts of `data` (split `test`) for each of
    `bench.rounds` rounds.
    output_dir: default `bench.output_dir`; one of them must be set.
    bench.random_pair: time a random pair shaped like the tiny world instead (random prompts; no world, no data).
    """

    rounds = max(1, bench.rounds)  # bench.num_prompts prompts a round
    out_dir = output_dir or bench.output_dir
    if out_dir is None:
        raise ValueError("run_bench needs output_dir (or bench.output_dir)")
    if bench.random_pair:
        target, draft, tokenizer = random_pair(resolve_device(target_cfg.device), bench.seed)
        prompts = prompts or random_prompts(bench.num_prompts * rounds, bench.seed)
    else:
        target, draft, tokenizer = load_pair(target_cfg, draft_cfg, world)
    drafts = {bench.draft_label: draft}
    for label, path in bench.drafts.items() if not bench.random_pair else ():
        if path == draft_cfg.path:
            drafts = {label if k == bench.draft_label else k: v for k, v in drafts.items()}
            continue
        extra_cfg = ModelConfig(path=path, dtype=draft_cfg.dtype, device=draft_cfg.device)
        check_same_tokenizer(tokenizer, load_tokenizer(extra_cfg, world), ("target", f"draft {label!r}"))
        drafts[label] = load_drafter(extra_cfg, target, world)  # a draft head or a causal LM
    if prompts is None:
        if data is None:
            raise ValueError("run_bench needs prompts or a data config")
        prompts = load_heldout_prompts(data, tokenizer, world, bench.num_prompts * rounds)
    prompts = prompts[: bench.num_prompts * rounds]
    calibration, pool = plan_prompts(bench, data, tokenizer, world, prompts)
    rows = bench_pair(
        target,
        drafts,
        tokenizer,
        prompts,
        bench,
        decode,
        progress=progress,
        calibration=calibration,
        pool=pool,
    )
    device = next(target.parameters()).device
    meta = {
        "run": run_name,
        "target": "random (tiny-world shape)" if bench.random_pair else target_cfg.path,
        "drafts": {k: (draft_cfg.path if v is draft else bench.drafts.get(k)) for k, v in drafts.items()},
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "num_prompts": len(prompts),
        "max_new_tokens": bench.max_new_tokens,
        "top_p": decode.top_p,
        "top_k": decode.top_k,
        "warmup": bench.warmup,
        "rounds": len(round_prompts(prompts, bench.rounds)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    paths = write_report(rows, out_dir, meta)
    if show:
        print_table(rows, title=f"resispec bench: {run_name} ({meta['device']})")
        print("\n".join(best_lines(rows)))
        print(f"report: {paths['md']}")
    if logger is not None:
        log_wandb(rows, logger, Path(out_dir), run_name, meta)
    return rows
