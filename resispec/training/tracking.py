"""Run logging: W&B (offline by default) and a local `history.jsonl`, written by the main process only."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from resispec.training.config import LoggerConfig

WANDB_MODES = ("offline", "online", "disabled")


def flatten_eval(prefix: str, metrics: dict) -> dict[str, float]:
    """{"tau": {rule: t}, "alpha": {rule: {n: a}}, "per_depth": {rule: [a]}} -> flat W&B keys."""
    out = {f"{prefix}/fkl": metrics["fkl"]}
    for rule, t in metrics["tau"].items():
        out[f"{prefix}/tau/{rule}"] = t
        for n, a in metrics["alpha"][rule].items():
            out[f"{prefix}/alpha_n{n}/{rule}"] = a
        for d, a in enumerate(metrics["per_depth"][rule]):
            out[f"{prefix}/depth{d}/{rule}"] = a
    return out


class RunLogger:
    """W&B run named `<name>-<time>` holding the resolved config, plus history.jsonl in the run folder.
    Inactive on every process but the main one."""

    def __init__(self, accelerator, cfg: LoggerConfig, run_dir: Path, name: str, config: dict, resume: bool):
        self.active = accelerator.is_main_process
        self.run = None
        self.history = run_dir / "history.jsonl"
        if not self.active:
            return
        mode = cfg.wandb.mode
        if mode not in WANDB_MODES:
            raise ValueError(f"logger.wandb.mode must be one of {WANDB_MODES}, got {mode!r}")
        if mode == "disabled":
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        wandb_dir = Path(cfg.wandb.dir) if cfg.wandb.dir else run_dir
        wandb_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        self.run = wandb.init(
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}",
            dir=str(wandb_dir),
            mode=mode,
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
            reinit="finish_previous",
        )
        id_file.write_text(self.run.id)

    def log(self, values: dict[str, float], step: int) -> None:
        if not self.active:
            return
        with self.history.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.run is not None:
            self.run.log(values, step=step)

    def log_eval(self, prefix: str, metrics: dict, step: int) -> None:
        self.log(flatten_eval(prefix, metrics), step)

    def summary(self, metrics: dict) -> None:
        if self.run is not None:
            for phase in ("before", "after"):
                if metrics.get(phase):
                    for k, v in flatten_eval(phase, metrics[phase]).items():
                        self.run.summary[k] = v
            self.run.summary["best_step"] = metrics["best_step"]

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
