"""The main job on one recipe's model pair: build or reuse the world, distill the draft (regenerating the data
with the target first, cached), then measure the end-to-end speedup of the initial and the distilled draft.

Entry point: `python train/pipeline.py [+recipe=NAME] [overrides]` (what `bash scripts/main.sh` runs).
Every stage is the same library call its own script makes, so the stages can also be run one by one.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from resispec.config import ResiSpecConfig


def run_pipeline(cfg: ResiSpecConfig, output_dir: str | Path, resolved_config: dict | None = None) -> dict:
    """Run world -> distill -> bench under `output_dir` (distill/ and bench/ sub-folders). Returns a summary."""
    from resispec.models import ensure_world, format_report
    from resispec.serving.bench import run_bench
    from resispec.training import distill, format_metrics

    out = Path(output_dir)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    if any(m.path.startswith("world:") for m in (cfg.target, cfg.draft)):
        print(format_report(ensure_world(cfg.world).report))  # losses, perplexities, ms/token of the pair
    timings["world_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = distill(
        cfg.world, cfg.target, cfg.draft, cfg.data, cfg.decode, cfg.loss, cfg.optim, cfg.train, cfg.logger,
        output_dir=out / "distill", name=cfg.name, resolved_config=resolved_config,
    )  # fmt: skip
    timings["distill_s"] = time.perf_counter() - t0
    print("\nHeld-out acceptance (alpha per rule) and simulated tau, before vs after distillation:")
    print(format_metrics(result.metrics))

    # The initial draft and the distilled one, each against plain AR decoding of the target, in one run.
    t0 = time.perf_counter()
    bench = dataclasses.replace(cfg.bench, draft_label="initial", drafts={"distilled": str(result.draft_dir)})
    rows = run_bench(
        bench, cfg.decode, cfg.target, cfg.draft, cfg.world, cfg.data, cfg.logger,
        output_dir=out / "bench", run_name=cfg.name,
    )  # fmt: skip
    timings["bench_s"] = time.perf_counter() - t0

    summary = {"distill_dir": str(result.output_dir), "draft_dir": str(result.draft_dir),
               "bench_dir": str(out / "bench"), "timings": timings, "num_bench_rows": len(rows)}  # fmt: skip
    print(f"\ndistilled draft: {result.draft_dir}\nreports: {out / 'bench' / 'report.md'}, "
          f"{result.output_dir / 'metrics.json'}")  # fmt: skip
    print("stage times: " + ", ".join(f"{k[:-2]} {v / 60:.1f} min" for k, v in timings.items()))
    return summary
