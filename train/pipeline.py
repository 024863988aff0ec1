"""The main job:  python train/pipeline.py [+recipe=NAME] [overrides]   (what `bash scripts/main.sh` runs)

Models (the tiny world built or reused; a real recipe's hub pair, or with `standin=true` its local stand-in) ->
target regeneration (cached) -> distillation (forward KL by default) -> held-out acceptance before/after ->
end-to-end speedup of the initial and the distilled draft vs AR -> the distilled draft exported for vLLM / SGLang.
Outputs go to outputs/pipeline/<name>/<time>/{distill,bench,export}/. Every stage is the same library call its own
script makes (train/pretrain.py, train/distill.py, bench/speed.py, train/export.py), so the stages can also be run
one by one.

  python train/pipeline.py                                  # the tiny world
  python train/pipeline.py +recipe=llama3 standin=true      # a real recipe on its local stand-in (no download)
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from resispec.config import ResiSpecConfig, register_configs, to_typed
from resispec.errors import exit_on_user_error

if TYPE_CHECKING:
    from resispec.training import DistillJob

register_configs()


INITIAL_DRAFT_RULES = ["chain", "resispec"]


class StageClock:
    """Stage headers with an estimate of the time left, from this machine's previous runs of the same stages
    (kept in `history`, a small JSON file in the world cache). Each stage's own progress bar then shows its
    live time left; this adds the whole job's."""

    def __init__(
        self, history: Path, stages: list[tuple[str, str]], defaults: dict[str, float] | None = None
    ):
        self.history = history
        self.stages = stages  # (key, title) in order; the key names the stage in the history
        try:
            self.past: dict[str, float] = json.loads(history.read_text())
        except (OSError, ValueError):
            self.past = {}
        self.past = {**(defaults or {}), **self.past}  # e.g. a cached world: ~0 s before it was ever timed
        self.timings: dict[str, float] = {}
        self._t0 = self._job_t0 = time.perf_counter()

    def _left(self, from_index: int) -> float | None:
        past = [self.past.get(key) for key, _ in self.stages[from_index:]]
        return None if any(p is None for p in past) else sum(past)

    def start(self, key: str) -> None:
        i = [k for k, _ in self.stages].index(key)
        title = self.stages[i][1]
        left = self._left(i)
        elapsed = (time.perf_counter() - self._job_t0) / 60
        est = (
            f"job time left ~{left / 60:.1f} min (this stage ~{self.past[key] / 60:.1f} min, from the last run here)"
            if left is not None
            else "no earlier run here to estimate from; the stage's bar shows its own time left"
        )
        print(f"\n== [{i + 1}/{len(self.stages)}] {title} | {elapsed:.1f} min so far | {est}", flush=True)
        self._t0 = time.perf_counter()

    def stop(self, key: str) -> None:
        self.timings[key] = time.perf_counter() - self._t0
        self.past[key] = self.timings[key]
        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self.history.write_text(json.dumps(self.past, indent=1, sort_keys=True))
        except OSError:  # a read-only cache only loses the estimate
            pass


def beside_head_job(job: DistillJob) -> DistillJob | None:
    """The job of a draft head trained beside the standalone draft (draft.head.beside): the draft's job with
    draft.kind=head, its own train.max_steps where draft.head.max_steps is set, under distill_head/; None when no
    head trains beside it."""
    draft = job.draft
    if draft.kind == "head" or not draft.head.beside:
        return None
    steps = draft.head.max_steps or job.train.max_steps
    return dataclasses.replace(
        job,
        draft=dataclasses.replace(draft, kind="head"),
        train=dataclasses.replace(job.train, max_steps=steps),
        output_dir=Path(job.output_dir).parent / "distill_head",
        name=job.name + "_head",
    )


def run_pipeline(cfg: ResiSpecConfig, output_dir: str | Path, resolved_config: dict | None = None) -> dict:
    """Run models -> distill -> bench -> export under `output_dir` (distill/, bench/ and export/ sub-folders).
    Returns a summary."""
    from resispec.benchmark.speed import run_bench
    from resispec.models import cache_root, ensure_world, format_report, load_world
    from resispec.models.export import ExportError, export_draft
    from resispec.models.standin import format_standin, standin_report
    from resispec.training import JOB_SECTIONS, DistillJob, distill, format_metrics

    out = Path(output_dir)
    uses_world = any(m.path.startswith("world:") for m in (cfg.target, cfg.draft))
    standin = standin_report(
        cfg.target.path
    )  # set when standin=true swapped the hub pair (built in to_typed)
    cached = not uses_world or load_world(cfg.world) is not None
    if uses_world:
        models_key = f"{cfg.name}/world_{'cached' if cached else 'build'}"
        models_title = f"world {cfg.world.name}: " + ("cached" if cached else "build (once per machine)")
    elif standin is not None:
        models_key = f"{cfg.name}/standin"
        models_title = f"stand-in of {standin['target']} + {standin['draft']} and {standin['dataset']}: ready"
    else:
        models_key = f"{cfg.name}/models"
        models_title = f"models {cfg.target.path} + {cfg.draft.path} (loaded by each stage)"
    clock = StageClock(
        cache_root(cfg.world) / "pipeline_times.json",
        [
            (models_key, models_title),
            (f"{cfg.name}/distill", "regenerate with the target (cached) and distill the draft"),
            (f"{cfg.name}/bench", "bench: AR vs every rule x tree, initial and distilled draft"),
            (f"{cfg.name}/export", "export the distilled draft for vLLM / SGLang"),
        ],
        defaults={models_key: 1.0} if cached else None,
    )

    clock.start(models_key)
    if uses_world:
        print(format_report(ensure_world(cfg.world).report))  # losses, perplexities, ms/token of the pair
    elif standin is not None:
        print(format_standin(standin))
    clock.stop(models_key)

    clock.start(f"{cfg.name}/distill")
    sections = {k: getattr(cfg, k) for k in JOB_SECTIONS}
    job = DistillJob(**sections, output_dir=out / "distill", name=cfg.name, resolved_config=resolved_config)
    result = distill(job)
    head_result = None
    head_job = beside_head_job(job)
    if head_job is not None:
        head_result = distill(head_job)
        print("\nHeld-out acceptance of the draft head (depth d drafted from its own state, as in decoding):")
        print(format_metrics(head_result.metrics))
    clock.stop(f"{cfg.name}/distill")
    m = result.metrics
    if m.get("train_tokens_per_s"):
        print(
            f"\ndistillation: {m['steps']} steps, {m['tokens']:,} response tokens in {m['train_step_seconds']:.0f} s "
            f"of training steps = {m['train_tokens_per_s']:,.0f} tokens/s (evaluation and checkpoints excluded)"
        )
    print("\nHeld-out acceptance (alpha per rule) and simulated tau, before vs after distillation:")
    print(format_metrics(result.metrics))

    # The initial draft and the distilled one, each against plain AR decoding of the target, in one run.
    clock.start(f"{cfg.name}/bench")
    # the initial draft is the "before": its chain and resispec rows (and tree=auto, HF assisted) say what
    # distillation changed; every rule runs on the distilled draft (bench.draft_rules.initial widens it)
    bench = dataclasses.replace(
        cfg.bench,
        draft_label="initial",
        drafts={
            "distilled": str(result.draft_dir),
            **({"head": str(head_result.draft_dir)} if head_result else {}),
        },
        draft_rules={"initial": INITIAL_DRAFT_RULES, **cfg.bench.draft_rules},
    )
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
    clock.stop(f"{cfg.name}/bench")

    # the draft/ folder is plain HF (LoRA merged); the export checks it against the target and writes SERVE.md
    clock.start(f"{cfg.name}/export")
    try:
        exported = export_draft(str(result.draft_dir), cfg.target.path, out / "export", world=cfg.world)
        export_line = f"exported ({exported.checks['backend']}): {exported.out_dir / 'SERVE.md'}"
    except ExportError as err:  # e.g. the micro world's head_dim 16, which no vLLM CPU kernel takes
        exported, export_line = None, f"not exported: {err}"
    if head_result is not None:  # the head in vLLM's eagle3 layout (resispec/models/head_export.py)
        try:
            head_export = export_draft(
                str(head_result.draft_dir), cfg.target.path, out / "export_head", world=cfg.world
            )
            export_line += (
                f"\nhead exported ({head_export.checks['backend']}): {head_export.out_dir / 'SERVE.md'}"
            )
        except ExportError as err:
            export_line += f"\nhead not exported: {err}"
    clock.stop(f"{cfg.name}/export")
    timings = {key.split("/")[-1]: seconds for key, seconds in clock.timings.items()}

    print(f"\ndistilled draft: {result.draft_dir}")
    print(export_line)
    print(f"reports: {bench_dir / 'report.md'}, {result.output_dir / 'metrics.json'}")
    print("stage times: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()))
    return {
        "distill_dir": str(result.output_dir),
        "draft_dir": str(result.draft_dir),
        "head_dir": str(head_result.draft_dir) if head_result is not None else None,
        "bench_dir": str(bench_dir),
        "export_dir": str(exported.out_dir) if exported is not None else None,
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
