"""Distill (or LoRA-tune) the draft toward the target:  python train/distill.py [+recipe=NAME] [key=value ...]

Multi-GPU:  accelerate launch --config_file recipes/accelerate/<config>.yaml train/distill.py +recipe=llama3
Multi-process on CPU:  torchrun --nproc_per_node 2 train/distill.py +recipe=debug   (see recipes/accelerate/README.md for
FSDP on CPU)
Outputs go to outputs/distill/<name>/<time>/ (draft/, metrics.json, config.yaml); outputs/distill/<name>/latest
points at the newest finished run.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from resispec.config import register_configs, to_typed
from resispec.errors import exit_on_user_error

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="distill")
@exit_on_user_error
def main(cfg) -> None:
    from resispec.training import JOB_SECTIONS, DistillJob, distill, format_metrics

    c = to_typed(cfg)
    job = DistillJob(
        **{k: getattr(c, k) for k in JOB_SECTIONS},
        output_dir=c.train.output_dir or HydraConfig.get().runtime.output_dir,
        name=c.name,
        resolved_config=OmegaConf.to_container(cfg, resolve=True),
    )
    result = distill(
        job
    )  # a UserError (missing model, bad config, ...) is printed as one line by the decorator
    if result.is_main:
        print(format_metrics(result.metrics))
        print(f"draft: {result.draft_dir}")


if __name__ == "__main__":
    main()
