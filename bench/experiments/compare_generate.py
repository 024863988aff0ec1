"""Regeneration engines compared on the same prompts: built-in (HF generate, batched) vs vLLM's offline API.

python bench/experiments/compare_generate.py [--target world:target] [--n 32] [--max-new-tokens 64]

Prints tokens/s of each engine (generation only; vLLM's start-up is reported apart), whether the greedy (T = 0)
responses are identical, and at T = 1 the distribution check of each engine's samples against the target
(mean NLL of the sampled tokens vs mean entropy: equal in expectation for samples of the target).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from resispec.benchmark.vllm_peer import distribution_check
from resispec.data.config import DataConfig, RegenConfig
from resispec.data.prompts import load_prompts
from resispec.data.regen import _generate_batch
from resispec.models import load_model, load_tokenizer, resolve_model_path
from resispec.models.config import ModelConfig
from resispec.vllm_venv import offline_generate, vllm_version


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="world:target")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()

    cfg = ModelConfig(path=args.target)
    target_dir = resolve_model_path(cfg.path)
    tok = load_tokenizer(cfg)
    target = load_model(cfg)
    prompts = [list(p) for p in load_prompts(DataConfig(), tok, "train")["prompt_ids"][: args.n]]
    report: dict = {
        "vllm": vllm_version(),
        "target": target_dir,
        "prompts": len(prompts),
        "threads": torch.get_num_threads(),
    }
    for temperature in (0.0, 1.0):
        regen = RegenConfig(
            max_new_tokens=args.max_new_tokens, temperature=temperature, batch_size=args.batch_size
        )
        start = time.perf_counter()
        ours = []
        for b in range(0, len(prompts), regen.batch_size):
            torch.manual_seed(b)
            ours += _generate_batch(
                target, prompts[b : b + regen.batch_size], regen, tok.pad_token_id, tok.eos_token_id
            )
        hf_s = time.perf_counter() - start
        start = time.perf_counter()
        res = offline_generate(
            target_dir, prompts, args.max_new_tokens, temperature, eos_token_id=tok.eos_token_id
        )
        wall = time.perf_counter() - start
        theirs = res["responses"]
        row = {
            "hf_tokens_per_s": sum(map(len, ours)) / hf_s,
            "vllm_tokens_per_s": sum(map(len, theirs)) / res["seconds"],
            "vllm_wall_s_incl_startup": wall,
            "hf_s": hf_s,
            "vllm_generate_s": res["seconds"],
        }
        if temperature == 0:
            row["greedy_identical_prompts"] = sum(a == b for a, b in zip(ours, theirs, strict=True))
        else:
            row["check_hf"] = distribution_check(target, prompts, ours, 1.0)
            row["check_vllm"] = distribution_check(target, prompts, theirs, 1.0)
        report[f"T={temperature:g}"] = row
    print(json.dumps(report, indent=2, default=float))


if __name__ == "__main__":
    main()
