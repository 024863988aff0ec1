"""OpenAI-compatible server for the target with its draft:  python serve/server.py [+recipe=NAME] [key=value ...]

Examples:
  python serve/server.py                                   # the embedded tiny pair on 127.0.0.1:8000
  python serve/server.py +recipe=debug server.port=8123     # the micro pair
  python serve/server.py decode.rule=rrs decode.tree=[1,1,1,1] server.api_key=secret
  python serve/server.py decode.tree=auto                  # the planner picks the tree on this device at start-up
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from resispec.config import register_configs, to_typed
from resispec.errors import exit_on_user_error
from resispec.serving.server import serve

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    c = to_typed(cfg)
    serve(c.server, c.decode, c.target, c.draft, c.world, c.data)


if __name__ == "__main__":
    main()
