"""Build (or reuse) the embedded tiny world: tokenizer, target, draft, report.

python train/pretrain.py                  # the tiny world (<= 15 min on 2 CPU cores, cached)
python train/pretrain.py +recipe=debug    # the micro world (< 1 min)
python train/pretrain.py world.cache_dir=/some/folder
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from resispec.config import register_configs, to_typed

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="pretrain")
def main(cfg: DictConfig) -> None:
    from resispec.models import ModelNotFoundError, ensure_world, format_report

    world = to_typed(cfg).world
    try:
        paths = ensure_world(world)
    except ModelNotFoundError as err:  # one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    print(format_report(paths.report))
    print(f"target: {paths.target_dir}\ndraft:  {paths.draft_dir}\nreport: {paths.root / 'report.json'}")


if __name__ == "__main__":
    main()
