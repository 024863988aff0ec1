"""Batch-1 decoder speed:  python bench/speed.py [+recipe=NAME] [key=value ...]

  python bench/speed.py                        # the tiny pair: AR vs each rule x tree, HF assisted; report.md/json/png
  python bench/speed.py +recipe=debug          # the micro pair, a few seconds of work
  python bench/speed.py bench.random_pair=true # a random pair shaped like the tiny world: speed only, no world needed
  python bench/speed.py bench.draft_label=initial "+bench.drafts={distilled: 'outputs/distill/tiny/latest/draft'}"
  python bench/speed.py bench.vllm=true        # vLLM's AR and speculative rows beside ours (scripts/setup_vllm.sh)

Load (running servers, or every serving mode in one process) is bench/load.py. Outputs go to bench.output_dir, else
the Hydra run folder (outputs/bench/<name>/<time>/).
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from resispec.benchmark.speed import run_bench
from resispec.config import register_configs, to_typed
from resispec.errors import exit_on_user_error

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    c = to_typed(cfg)
    out_dir = c.bench.output_dir or HydraConfig.get().runtime.output_dir
    run_bench(c.bench, c.decode, c.target, c.draft, c.world, c.data, c.logger, out_dir, run_name=c.name)


if __name__ == "__main__":
    main()
