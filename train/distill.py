"""Distill (or LoRA-tune) the draft toward the target:  python train/distill.py [+recipe=NAME] [key=value ...]

Multi-GPU:  accelerate launch --config_file recipes/accelerate/<config>.yaml train/distill.py +recipe=llama3
Multi-process on CPU:  torchrun --nproc_per_node 2 train/distill.py +recipe=debug   (see recipes/README.md for
FSDP on CPU)
Outputs go to outputs/distill/<name>/<time>/ (draft/, metrics.json, config.yaml); outputs/distill/<name>/latest
points at the newest finished run.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from resispec.config import register_configs, to_typed

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="distill")
def main(cfg) -> None:
    from resispec.data import DataNotFoundError
    from resispec.models import ModelNotFoundError, TokenizerMismatchError
    from resispec.training import JOB_SECTIONS, USER_ERRORS, DistillJob, distill, format_metrics

    c = to_typed(cfg)
    job = DistillJob(
        **{k: getattr(c, k) for k in JOB_SECTIONS},
        output_dir=c.train.output_dir or HydraConfig.get().runtime.output_dir,
        name=c.name,
        resolved_config=OmegaConf.to_container(cfg, resolve=True),
    )
    try:
        result = distill(job)
    except (ModelNotFoundError, TokenizerMismatchError, DataNotFoundError, *USER_ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)  # one line: these are the user's to fix, not bugs
        sys.exit(2)
    if result.is_main:
        print(format_metrics(result.metrics))
        print(f"draft: {result.draft_dir}")


if __name__ == "__main__":
    main()
