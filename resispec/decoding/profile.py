"""Quick speed check of the decoder on the device at hand: AR vs speculative (rules x trees) vs HF assisted.

    python -m resispec.decoding.profile --random                      # random tiny-world-shaped pair
    python -m resispec.decoding.profile --target DIR --draft DIR --prompts-npy DIR/splits/test.npy

Reports tokens/s, tau, per-depth acceptance, c (draft forward / target forward time) and the speedup over AR
measured in the same run, as a markdown table. The full benchmark (JSON, plot, server) is serve/bench.py; this is
the decoder's own profiling helper.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from resispec.decoding.engine import SpeculativeDecoder


def _timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def bench_pair(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: Sequence[torch.Tensor],  # each [1, L] on the models' device
    rules: Sequence[str] = ("resispec", "rrs", "rsd", "gumbel"),
    trees: Sequence[Sequence[int]] = ((1, 1, 1, 1), (2, 1, 1), (4, 2, 1, 1)),
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int = 64,
    hf_assisted: Sequence[int] = (2, 4),
    seed: int = 0,
    repeats: int = 2,
) -> list[dict]:
    """One row per (temperature, method); every method decodes the same prompts.

    Methods run interleaved, `repeats` rounds, after one untimed warm-up each; a method's row is its fastest round
    (a shared, noisy machine only ever slows a round down, and interleaving spreads load drift over all methods).
    HF assisted rows use `num_assistant_tokens` = k with the constant schedule."""
    rows = []
    for temp in temperatures:
        settings = dict(max_new_tokens=max_new_tokens, temperature=temp, eos_token_id=[])
        methods: dict[str, object] = {}
        ar_dec = SpeculativeDecoder(target, draft, rule=rules[0], tree=trees[0])
        methods["AR"] = lambda gen, d=ar_dec, s=settings: [
            d.generate_autoregressive(p, **s).stats for p in prompts
        ]
        for rule in rules:
            for tree in trees:
                dec = SpeculativeDecoder(target, draft, rule=rule, tree=tree)
                methods[f"{rule} {list(tree)}"] = lambda gen, d=dec, s=settings: [
                    d.generate(p, generator=gen, **s).stats for p in prompts
                ]
        for k in hf_assisted:
            kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=temp > 0)
            if temp > 0:
                kwargs.update(temperature=temp, top_k=0, top_p=1.0)

            def run_hf(gen, k=k, kwargs=kwargs):
                draft.generation_config.num_assistant_tokens = k
                draft.generation_config.num_assistant_tokens_schedule = "constant"
                n = 0
                for p in prompts:
                    out = target.generate(
                        p, attention_mask=torch.ones_like(p), assistant_model=draft, pad_token_id=0, **kwargs
                    )
                    n += out.shape[1] - p.shape[1]
                return n

            methods[f"HF assisted k={k}"] = run_hf
        best: dict[str, tuple[float, object]] = {}
        for rnd in range(repeats + 1):
            for name, fn in methods.items():
                gen = torch.Generator(device=prompts[0].device).manual_seed(seed + rnd)
                seconds, out = _timed(lambda fn=fn, gen=gen: fn(gen))
                if rnd > 0 and (name not in best or seconds < best[name][0]):  # round 0 = warm-up
                    best[name] = (seconds, out)
        ar_tps = sum(st.num_new_tokens for st in best["AR"][1]) / best["AR"][0]
        for name, (seconds, out) in best.items():
            if isinstance(out, int):  # HF assisted: a token count
                rows.append(dict(temperature=temp, method=name, tokens_per_s=out / seconds))
                rows[-1]["speedup"] = rows[-1]["tokens_per_s"] / ar_tps
                continue
            tokens = sum(st.num_new_tokens for st in out)
            row = dict(
                temperature=temp,
                method=name,
                tokens_per_s=tokens / seconds,
                speedup=tokens / seconds / ar_tps,
            )
            if name != "AR":
                num_drafts = sum(st.num_drafts for st in out)
                acc = [sum(col) for col in zip(*(st.accepted_per_position for st in out), strict=True)]
                reach = [sum(col) for col in zip(*(st.reached_per_position for st in out), strict=True)]
                d_s, t_s = sum(st.draft_seconds for st in out), sum(st.target_seconds for st in out)
                d_fw, t_fw = sum(st.draft_forwards for st in out), sum(st.target_forwards for st in out)
                row.update(
                    tau=(sum(st.num_accepted_tokens for st in out) + num_drafts) / max(num_drafts, 1),
                    per_depth=[round(a / r, 2) if r else 0.0 for a, r in zip(acc, reach, strict=True)],
                    c=(d_s / max(d_fw, 1)) / (t_s / max(t_fw, 1)),
                )
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = "| T | method | tokens/s | tau | per-depth acceptance | c | speedup |\n|---|---|---|---|---|---|---|\n"
    body = []
    for r in rows:
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        c = f"{r['c']:.3f}" if "c" in r else "-"
        body.append(
            f"| {r['temperature']} | {r['method']} | {r['tokens_per_s']:.1f} | {tau} | "
            f"{r.get('per_depth', '-')} | {c} | {r['speedup']:.2f} |"
        )
    return head + "\n".join(body)


def _random_pair(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(hidden, layers, heads, seed):
        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=8192,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
        return LlamaForCausalLM(cfg).to(device).eval()

    return make(256, 12, 4, 0), make(96, 1, 2, 1)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--random", action="store_true", help="random pair shaped like the tiny world")
    ap.add_argument("--prompts-npy", help="a token-id .npy (e.g. a world split); prompts are slices of it")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rules", default="resispec,rrs,rsd,gumbel")
    ap.add_argument("--trees", default="1-1-1-1,2-1-1,4-2-1-1")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random:
        target, draft = _random_pair(args.device)
    else:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target).to(args.device).eval()
        draft = AutoModelForCausalLM.from_pretrained(args.draft).to(args.device).eval()
    gen = torch.Generator().manual_seed(0)
    if args.prompts_npy:
        import numpy as np

        ids = torch.from_numpy(np.load(args.prompts_npy).astype("int64")).flatten()
        starts = torch.randint(0, ids.numel() - args.prompt_len, (args.num_prompts,), generator=gen)
        prompts = [ids[s : s + args.prompt_len][None].to(args.device) for s in starts.tolist()]
    else:
        vocab = target.get_output_embeddings().weight.shape[0]
        prompts = [
            torch.randint(0, vocab, (1, args.prompt_len), generator=gen).to(args.device)
            for _ in range(args.num_prompts)
        ]
    rows = bench_pair(
        target,
        draft,
        prompts,
        rules=args.rules.split(","),
        trees=[tuple(int(b) for b in t.split("-")) for t in args.trees.split(",")],
        temperatures=[float(t) for t in args.temperatures.split(",")],
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
    )
    print(
        f"device {args.device}, threads {torch.get_num_threads()}, {len(prompts)} prompts x {args.max_new_tokens}"
    )
    print(markdown(rows))


if __name__ == "__main__":
    main()
