"""Headroom report:  python bench/headroom.py [+recipe=NAME] [headroom.key=value ...]

  python bench/headroom.py +recipe=debug                                   # the micro pair, a minute or two
  python bench/headroom.py +recipe=tiny headroom.positions=200 headroom.calibration_positions=100

Per-node α of every rule against the bounds, and a calibrated resispec_auto policy (resispec/analysis/headroom.py).
Outputs go to headroom.output_dir, else the Hydra run folder (outputs/headroom/<name>/<time>/).
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from resispec.analysis.headroom import run
from resispec.config import register_configs, to_typed
from resispec.errors import exit_on_user_error

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="headroom")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    c = to_typed(cfg)
    hc = HydraConfig.get()
    out_dir = c.headroom.output_dir or hc.runtime.output_dir
    command = " ".join(["python bench/headroom.py", *hc.overrides.task])
    run(c.headroom, c.target, c.draft, c.world, out_dir, command)


if __name__ == "__main__":
    main()
