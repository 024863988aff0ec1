"""Export a tuned draft for vLLM / SGLang: a plain HF checkpoint (LoRA merged) + tokenizer + serve commands.

python train/export.py --draft outputs/distill/tiny/latest/draft --target world:target --out exports/tiny
python train/export.py --draft meta-llama/Llama-3.2-1B-Instruct --adapter outputs/.../adapter \
    --target meta-llama/Llama-3.1-8B-Instruct --backend vllm-flash-attn --tp 4 --out exports/llama3

Compatibility (vocabulary, special tokens, context length, head_dim on --backend) is checked first; a failure is one
line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from resispec.models.export import HEAD_DIMS, ExportError, default_backend, export_draft
    from resispec.models.loading import ModelNotFoundError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--draft", required=True, help="draft folder / hub name / world:draft (the LoRA base with --adapter)"
    )
    ap.add_argument("--target", default="world:target")
    ap.add_argument("--out", required=True, help="output folder (replaced atomically)")
    ap.add_argument("--adapter", default=None, help="a peft LoRA adapter folder to merge into the draft")
    ap.add_argument(
        "--backend",
        default=None,
        choices=sorted(HEAD_DIMS),
        help=f"attention backend whose head sizes are checked (default here: {default_backend()}; "
        "vllm-flash-attn where CUDA is present, else vllm-cpu)",
    )
    ap.add_argument("--k", type=int, default=2, help="num_speculative_tokens in the serve commands")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size in the GPU commands")
    ap.add_argument("--max-model-len", type=int, default=None, help="server context (default: the target's)")
    ap.add_argument("--dtype", default="auto", help="auto (the checkpoint's) | float32 | bfloat16 | float16")
    args = ap.parse_args(argv)
    try:
        res = export_draft(
            args.draft,
            args.target,
            args.out,
            adapter=args.adapter,
            backend=args.backend,
            k=args.k,
            tp=args.tp,
            max_model_len=args.max_model_len,
            dtype=args.dtype,
        )
    except (ExportError, ModelNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"exported {res.out_dir} ({res.checks['backend']}: head_dim {res.checks['head_dim']})")
    print(f"serve: {res.out_dir / 'SERVE.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
