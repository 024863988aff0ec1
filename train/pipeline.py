"""The main job:  python train/pipeline.py [+recipe=NAME] [overrides]   (what `bash scripts/main.sh` runs)

World (build or reuse) -> target regeneration (cached) -> distillation (forward KL by default) -> held-out
acceptance before/after -> end-to-end speedup of the initial and the distilled draft vs AR. Outputs go to
outputs/pipeline/<name>/<time>/{distill,bench}/. Every stage is the same library call its own script makes
(train/pretrain.py, train/distill.py, serve/bench.py), so the stages can also be run one by one.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from resispec.config import ResiSpecConfig, register_configs, to_typed
from resispec.errors import exit_on_user_error

register_configs()


def run_pipeline(cfg: ResiSpecConfig, output_dir: str | Path, resolved_config: dict | None = None) -> dict:
    """Run world -> distill -> bench under `output_dir` (distill/ and bench/ sub-folders). Returns a summary."""
    from resispec.models import ensure_world, format_report
    from resispec.serving.bench import run_bench
    from resispec.training import JOB_SECTIONS, DistillJob, distill, format_metrics

    out = Path(output_dir)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    if any(m.path.startswith("world:") for m in (cfg.target, cfg.draft)):
        print(format_report(ensure_world(cfg.world).report))  # losses, perplexities, ms/token of the pair
    timings["world_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    sections = {k: getattr(cfg, k) for k in JOB_SECTIONS}
    job = DistillJob(**sections, output_dir=out / "distill", name=cfg.name, resolved_config=resolved_config)
    result = distill(job)
    timings["distill_s"] = time.perf_counter() - t0
    print("\nHeld-out acceptance (alpha per rule) and simulated tau, before vs after distillation:")
    print(format_metrics(result.metrics))

    # The initial draft and the distilled one, each against plain AR decoding of the target, in one run.
    t0 = time.perf_counter()
    bench = dataclasses.replace(cfg.bench, draft_label="initial", drafts={"distilled": str(result.draft_dir)})
    bench_dir = out / "bench"
    rows = run_bench(
        bench,
        cfg.decode,
        cfg.target,
        cfg.draft,
        cfg.world,
        cfg.data,
        cfg.logger,
        output_dir=bench_dir,
        run_name=cfg.name,
    )
    timings["bench_s"] = time.perf_counter() - t0

    print(f"\ndistilled draft: {result.draft_dir}")
    print(f"reports: {bench_dir / 'report.md'}, {result.output_dir / 'metrics.json'}")
    print("stage times: " + ", ".join(f"{k[:-2]} {v / 60:.1f} min" for k, v in timings.items()))
    return {
        "distill_dir": str(result.output_dir),
        "draft_dir": str(result.draft_dir),
        "bench_dir": str(bench_dir),
        "timings": timings,
        "num_bench_rows": len(rows),
    }


@hydra.main(version_base="1.3", config_path="../conf", config_name="distill")
@exit_on_user_error
def main(cfg) -> None:
    run_pipeline(
        to_typed(cfg), HydraConfig.get().runtime.output_dir, OmegaConf.to_container(cfg, resolve=True)
    )


if __name__ == "__main__":
    main()
