"""Peak CPU memory of one distillation loss step at a real vocabulary, above the models' own:
    python bench/loss_memory.py [--vocab 128256] [--positions 4096] [--rows 4] [--loss fkl] [--chunk N] [--json]

Each measurement runs in a fresh subprocess (this script with --inline) so nothing of a previous variant stays
resident; what is measured and how: resispec/analysis/loss_memory.py. argparse, not Hydra: a handful of sizes, no
model, world or config group to compose.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from resispec.analysis.loss_memory import measure


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--loss", default="fkl")
    ap.add_argument("--chunk", type=int, default=None, help="loss.chunk_size (default: the config's)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--inline", action="store_true", help="measure in this process (no subprocess)")
    args = ap.parse_args(argv)
    if args.inline:
        out = measure(args.vocab, args.positions, args.rows, args.loss, args.chunk)
        print(json.dumps(out))
        return 0
    cmd = [sys.executable, str(Path(__file__).resolve()), "--inline"]
    cmd += ["--vocab", str(args.vocab), "--positions", str(args.positions), "--rows", str(args.rows)]
    cmd += ["--loss", args.loss] + (["--chunk", str(args.chunk)] if args.chunk is not None else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        return res.returncode
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"V={out['vocab']} N={out['positions']} rows={out['rows']} loss={out['loss']}: "
            f"peak above the models {out['peak_above_models_mib']} MiB, step {out['step_s']} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
