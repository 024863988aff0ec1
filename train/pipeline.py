"""The main job:  python train/pipeline.py [+recipe=NAME] [overrides]   (what `bash scripts/main.sh` runs)

World (build or reuse) -> target regeneration (cached) -> distillation with the residual loss -> held-out
acceptance before/after -> end-to-end speedup of the initial and the distilled draft vs AR. Outputs go to
outputs/pipeline/<name>/<time>/{distill,bench}/.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from resispec.config import register_configs, to_typed
from resispec.errors import exit_on_user_error

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="distill")
@exit_on_user_error
def main(cfg) -> None:
    from resispec.data import DataNotFoundError
    from resispec.models import ModelNotFoundError, TokenizerMismatchError
    from resispec.pipeline import run_pipeline
    from resispec.training import USER_ERRORS

    try:
        run_pipeline(
            to_typed(cfg), HydraConfig.get().runtime.output_dir, OmegaConf.to_container(cfg, resolve=True)
        )
    except (ModelNotFoundError, TokenizerMismatchError, DataNotFoundError, *USER_ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)  # one line: these are the user's to fix, not bugs
        sys.exit(2)


if __name__ == "__main__":
    main()
