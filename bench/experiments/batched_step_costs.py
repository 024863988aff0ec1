"""Milliseconds per emitted token of the batched decoders, timed alone (no server): batched AR, the speculative
batch taking AR steps, and the speculative batch drafting a tree, at 1, 4 and 8 rows, T = 0, one torch thread.

python bench/experiments/batched_step_costs.py --draft <run>/distill/draft [--tree 3] [--forward fast hf]

--forward: the decoder's own forward (fast, the default) and/or the HF forward (hf), timed in the same run.

What the server's adaptive policy and the planner's per-batch-size plans should agree with (docs/serving_load.md).
"""

from __future__ import annotations

import argparse
import time

import torch

from resispec.decoding import SpeculativeDecoder
from resispec.decoding.batch import BatchedDecoder, BatchedSpeculativeDecoder
from resispec.models import load_pair
from resispec.models.config import ModelConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="world:target")
    ap.add_argument("--draft", default="world:draft")
    ap.add_argument("--tree", type=int, nargs="+", default=[3])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--forward", nargs="+", choices=["fast", "hf"], default=["fast"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    target, draft, tok = load_pair(ModelConfig(path=args.target), ModelConfig(path=args.draft))
    decs = {
        fwd: SpeculativeDecoder(
            target, draft, rule="resispec", tree=args.tree, tokenizer=tok, fast_forward=fwd == "fast"
        )
        for fwd in args.forward
    }
    texts = [
        "def main():\n    x = ",
        "import os\nimport sys\n\nclass Foo:\n    def ",
        "for i in range(10):\n",
        "return self.x + 1\n\n\ndef g(a, b):",
        "x = [",
        "while True:\n    ",
        "try:\n    import",
        "@property\ndef ",
    ]
    prompts = [tok(t)["input_ids"] for t in texts]
    tree = f"spec batch, tree {args.tree}"
    print(f"| forward | rows | batched AR | spec batch, AR steps | {tree} |\n|---|---|---|---|---|")
    for rows, (fwd, dec) in ((r, d) for r in (1, 4, 8) for d in decs.items()):
        ms = {}
        for label in ("batched AR", "spec batch, AR steps", tree):
            cls = BatchedDecoder if label == "batched AR" else BatchedSpeculativeDecoder
            batch = cls.from_decoder(dec)
            for p in prompts[:rows]:
                batch.add(p, max_new_tokens=60, temperature=0.0, eos_token_id=[])
            step = batch.step if label == "batched AR" else (lambda b=batch, d=label == tree: b.step(d))
            for _ in range(3):  # warm-up
                step()
            emitted, t0 = 0, time.perf_counter()
            for _ in range(args.steps):
                emitted += sum(len(chunk) for _, chunk in step())
            ms[label] = 1e3 * (time.perf_counter() - t0) / emitted
        ar = ms["batched AR"]
        print(
            f"| {fwd} | {rows} | {ar:.1f} | {ms['spec batch, AR steps']:.1f} | {ms[tree]:.1f} ({ar / ms[tree]:.2f}x) |"
        )


if __name__ == "__main__":
    main()
