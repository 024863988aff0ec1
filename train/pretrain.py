"""Build (or reuse) the embedded tiny world: tokenizer, target, draft, report.

python train/pretrain.py                  # the tiny world (<= 15 min on 2 CPU cores, cached)
python train/pretrain.py +recipe=debug    # the micro world (< 1 min)
python train/pretrain.py world.cache_dir=/some/folder
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from resispec.config import register_configs, to_typed
from resispec.errors import exit_on_user_error

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="pretrain")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    from resispec.models import ensure_world, format_report

    paths = ensure_world(to_typed(cfg).world)
    print(format_report(paths.report))
    print(f"target: {paths.target_dir}\ndraft:  {paths.draft_dir}\nreport: {paths.root / 'report.json'}")


if __name__ == "__main__":
    main()
