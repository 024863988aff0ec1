"""vLLM as a peer in the bench: AR and speculative decoding with the same draft, served from the isolated venv
(scripts/setup_vllm.sh) on 127.0.0.1, on the same prompts (as token ids), temperatures, lengths and seeds.

One server per vLLM method (AR; draft with greedy drafting; draft with probabilistic drafting, per k), started
once and reused across temperatures, so the bench interleaves vLLM's requests with our methods prompt by prompt.
tau and per-depth acceptance come from vLLM's own spec-decode counters on /metrics (the difference across the
timed requests). A peer that is wrong is reported as wrong, its speed not shown: at T = 0 its tokens must equal our
decoder's greedy output; at T > 0 the mean target NLL of its sampled tokens must match the mean target entropy at
the same positions (equal in expectation for on-distribution samples) within Monte Carlo error.

`bench_methods(...)` and `finish(...)` are the two hooks `benchmark.speed` calls when `bench.vllm` is set;
`load_sweep(...)` runs the load benchmark against one vLLM server. The process itself is `resispec.vllm_venv`.
"""

from __future__ import annotations

import atexit
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from resispec.benchmark.load import run_load_test
from resispec.benchmark.results import BenchRow, Method
from resispec.decoding import DecodeStats, SpeculativeDecoder
from resispec.sampling import filter_logits
from resispec.vllm_venv import FIX_LABEL, VllmServer, spec_config


def counters_to_stats(before: dict, after: dict, num_new_tokens: int):
    """The difference of two counter snapshots as DecodeStats (a chain: depth d+1 is reached iff d was accepted)."""
    n = len(after["accepted_per_pos"])
    prev = before["accepted_per_pos"] + [0.0] * (n - len(before["accepted_per_pos"]))
    acc = [int(round(a - b)) for a, b in zip(after["accepted_per_pos"], prev, strict=True)]
    drafts = int(round(after["num_drafts"] - before["num_drafts"]))
    reached = [drafts] + acc[:-1] if acc else []
    return DecodeStats(
        num_drafts=drafts,
        num_draft_tokens=int(round(after["num_draft_tokens"] - before["num_draft_tokens"])),
        num_accepted_tokens=int(round(after["num_accepted_tokens"] - before["num_accepted_tokens"])),
        accepted_per_position=acc,
        reached_per_position=reached,
        num_new_tokens=num_new_tokens,
    )


@torch.no_grad()
def distribution_check(
    target,
    prompt_ids: list[list[int]],
    outputs: list[list[int]],
    temperature: float,
    z: float = 4.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> dict:
    """Mean target NLL of sampled tokens vs mean target entropy at the same positions (temperature-scaled).

    For tokens sampled from the target, E[NLL_t - H_t | context] = 0, so the mean difference must be within
    z standard errors (+ 0.02 nats for float noise). Returns {ok, mean_nll, mean_entropy, diff, se, n}."""
    device = next(target.parameters()).device
    diffs, nlls, ents = [], [], []
    for p, o in zip(prompt_ids, outputs, strict=True):
        if not o:
            continue
        ids = torch.tensor([list(p) + list(o)], device=device)  # [1, P + N]
        logits = target(input_ids=ids).logits[0, len(p) - 1 : -1].float() / temperature  # [N, V]
        logits = filter_logits(logits, top_k, top_p)  # the samplers' own filter (resispec.sampling)
        logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(1, ids[0, len(p) :, None])[:, 0]  # [N]
        ent = -(logp.exp() * logp.clamp_min(-1e30)).nan_to_num().sum(-1)  # [N] (filtered tokens add 0)
        nlls.append(nll)
        ents.append(ent)
        diffs.append(nll - ent)
    if not diffs:
        return {"ok": False, "why": "no tokens"}
    d, nll, ent = torch.cat(diffs), torch.cat(nlls), torch.cat(ents)
    se = d.std().item() / math.sqrt(len(d)) if len(d) > 1 else float("inf")
    diff = d.mean().item()
    return {
        "ok": abs(diff) <= z * se + 0.02,
        "mean_nll": nll.mean().item(),
        "mean_entropy": ent.mean().item(),
        "diff": diff,
        "se": se,
        "n": len(d),
    }


@dataclass
class _Peer:
    """Shared by the vLLM methods of one bench run: the servers, our greedy references, the target."""

    target: Any
    reference: Any  # (prompt_ids, max_new_tokens) -> our decoder's greedy tokens
    servers: dict[str, VllmServer] = field(default_factory=dict)
    greedy: dict[tuple, list[int]] = field(default_factory=dict)


_PEERS: list[_Peer] = []


def stop_all() -> None:
    for peer in _PEERS:
        for s in peer.servers.values():
            s.stop()
    _PEERS.clear()


atexit.register(stop_all)


def vllm_ks(bench) -> list[int]:
    """k for vLLM's chains: `bench.vllm_k`, else the lengths of the chain trees in `bench.trees`, else [2]."""
    if bench.vllm_k:
        return sorted(set(bench.vllm_k))
    chains = sorted({len(t) for t in bench.trees if all(b == 1 for b in t)})
    return chains or [2]


def _model_dir(model) -> str:
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    if not path or not Path(path).exists():
        raise RuntimeError(f"vLLM peer needs models loaded from local folders; got {path!r}")
    return str(Path(path).resolve())


def _peer_for(target, drafts: dict, tokenizer, bench) -> _Peer:
    for peer in _PEERS:
        if peer.target is target:
            return peer
    first_draft = next(iter(drafts.values()))
    ar = SpeculativeDecoder(target, first_draft, rule="chain", tree=[1], tokenizer=tokenizer)
    device = next(target.parameters()).device
    eos = getattr(target.generation_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos

    def reference(p: list[int], max_new_tokens: int) -> list[int]:
        out = ar.generate_autoregressive(
            torch.tensor([p], device=device), max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=eos
        )
        return out.sequences[0, len(p) :].tolist()

    peer = _Peer(target=target, reference=reference)
    target_dir = _model_dir(target)
    dtype = "float32" if device.type == "cpu" else "auto"
    env = dict(bench.vllm_env)
    specs: dict[str, dict | None] = {"vllm AR": None}
    for label, draft in drafts.items():
        for k in vllm_ks(bench):
            for drafting in bench.vllm_drafting:
                specs[f"{label}|{drafting}|{k}"] = spec_config(_model_dir(draft), k, drafting)
    for key, spec in specs.items():
        peer.servers[key] = VllmServer(
            target_dir,
            spec,
            bench.vllm_python,
            dtype=dtype,
            env=env,
            args=bench.vllm_args,
            fix_cpu_sampling=bench.vllm_fix_cpu_sampling and spec is not None,
        )
    _PEERS.append(peer)
    try:
        for s in peer.servers.values():
            s.launch()
        for s in peer.servers.values():
            s.wait_ready()
    except Exception:
        stop_all()
        raise
    return peer


def bench_methods(target, drafts: dict, tokenizer, bench, temperature: float, sampling: dict) -> list:
    """The vLLM methods for `bench_pair` (AR, then each draft x drafting x k), timed like ours."""
    peer = _peer_for(target, drafts, tokenizer, bench)
    methods = []
    for key, server in peer.servers.items():
        if server.spec is None:
            row = BenchRow("vllm_ar", temperature, rule="vllm AR")
        else:
            label, drafting, k = key.split("|")
            rule = f"vllm {drafting}" + (f" {FIX_LABEL}" if server.fix_cpu_sampling else "")
            row = BenchRow("vllm_spec", temperature, draft=label, rule=rule, tree=f"chain {k}")
        state: dict[str, Any] = {
            "calls": 0,
            "prompts": [],
            "outputs": [],
            "before": None,
            "sampling": sampling,
        }

        def run(p, seed, max_new_tokens, server=server, state=state):
            if state["calls"] == 0 and bench.warmup == 0 and server.spec is not None:
                state["before"] = server.spec_counters()
            out = server.complete(
                p, max_new_tokens, temperature, seed, top_p=sampling["top_p"], top_k=sampling["top_k"]
            )
            state["calls"] += 1
            if state["calls"] > bench.warmup:
                state["prompts"].append(list(p))
                state["outputs"].append(out)
            elif state["calls"] == bench.warmup and server.spec is not None:
                state["before"] = server.spec_counters()  # after the last (untimed) warm-up request
            return len(out), None

        m = Method(row, run)
        m.vllm_state = state
        m.vllm_server = server
        m.vllm_peer = peer
        methods.append(m)
    return methods


def finish(methods: list, bench) -> None:
    """After the timed loop of one temperature: tau and per-depth acceptance from vLLM's counters, the peer check
    (a wrong peer gets its speed removed and the check's result in its rule), and the servers stopped after the
    last temperature."""
    ours_ar = next(m for m in methods if m.row.method == "ar")
    vllm_ar = next((m for m in methods if m.row.method == "vllm_ar"), None)
    peer = next((m.vllm_peer for m in methods if hasattr(m, "vllm_peer")), None)
    for m in methods:
        state = getattr(m, "vllm_state", None)
        if state is None:
            continue
        row, server = m.row, m.vllm_server
        if server.spec is None:
            row.tau = 1.0
        elif state["before"] is not None:
            stats = counters_to_stats(state["before"], server.spec_counters(), m.tokens)
            row.stats = stats.as_dict()
            row.tau = stats.tau
            row.per_depth_acceptance = stats.per_depth_acceptance
        if vllm_ar is not None and vllm_ar.tokens:
            row.stats["speedup_vs_vllm_ar"] = row.tokens_per_second / (vllm_ar.tokens / vllm_ar.seconds)
        row.stats["ours_ar_tokens_per_second"] = ours_ar.tokens / ours_ar.seconds
        row.stats["vllm_version"] = server.version()
        if row.temperature == 0:
            bad = 0
            for p, out in zip(state["prompts"], state["outputs"], strict=True):
                key = (tuple(p), bench.max_new_tokens)
                if key not in peer.greedy:
                    peer.greedy[key] = peer.reference(p, bench.max_new_tokens)
                bad += out != peer.greedy[key]
            check = {"ok": bad == 0, "prompts_differing": bad}
        else:
            check = distribution_check(
                peer.target,
                state["prompts"],
                state["outputs"],
                row.temperature,
                top_p=state["sampling"]["top_p"],
                top_k=state["sampling"]["top_k"],
            )
        row.stats["peer_check"] = check
        if not check["ok"]:
            why = "tokens differ from ours" if row.temperature == 0 else "off-distribution"
            row.rule += f" WRONG ({why})"
            row.tokens_per_second = None
            row.speedup = None
    if peer is not None and methods[0].row.temperature == bench.temperatures[-1]:
        for s in peer.servers.values():
            s.stop()
        if peer in _PEERS:
            _PEERS.remove(peer)


def load_sweep(
    target_dir: str,
    prompts: list[str],
    bench,
    concurrencies: list[int],
    draft_dir: str | None = None,
    k: int = 2,
    drafting: str = "probabilistic",
    temperature: float = 0.0,
) -> list[dict]:
    """The load benchmark (benchmark.load, same prompts and settings) against one vLLM server, at each
    concurrency. -> one dict per concurrency: the load-test result plus tau from vLLM's counters. With
    `bench.vllm_fix_cpu_sampling` a draft server runs with the CPU sampling fix, and its rows say so."""
    spec = spec_config(draft_dir, k, drafting) if draft_dir else None
    rows = []
    fix = bench.vllm_fix_cpu_sampling and spec is not None
    server = VllmServer(
        target_dir,
        spec,
        bench.vllm_python,
        env=dict(bench.vllm_env),
        args=bench.vllm_args,
        fix_cpu_sampling=fix,
    )
    with server as s:
        for c in concurrencies:
            b = replace(bench, concurrency=c, temperatures=[temperature])
            before = s.spec_counters()
            res = asdict(run_load_test(s.url, prompts, b, model=s.target, show=False))
            stats = counters_to_stats(before, s.spec_counters(), res["completion_tokens"])
            res.update(
                engine="vllm",
                method="AR" if spec is None else f"{drafting} chain {k}" + (f" {FIX_LABEL}" if fix else ""),
                server_tau=stats.tau if spec else None,
            )
            rows.append(res)
    return rows
