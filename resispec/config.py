"""The one Hydra schema shared by every entry script (pretrain, generate, distill, serve, bench, headroom).

Every primary config's defaults list is `resispec_schema`, then the groups, then `_self_`, so a misspelled
key fails when the config is composed. Recipes (conf/recipe/*.yaml, `# @package _global_`) can therefore
override any group in every script. Scripts convert with `OmegaConf.to_object` and pass the typed
sub-configs to the library; the library never sees the root.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore

from resispec.analysis.config import HeadroomConfig
from resispec.benchmark.config import BenchConfig
from resispec.data.config import DataConfig
from resispec.decoding.config import DecodeConfig
from resispec.losses import LossConfig
from resispec.models.config import ModelConfig, WorldConfig
from resispec.models.standin import apply_standin
from resispec.serving.config import ServerConfig
from resispec.training.config import LoggerConfig, OptimConfig, TrainConfig


@dataclass
class ResiSpecConfig:
    name: str = "tiny"  # run name: recipe name; used in output folders and W&B
    # true: the recipe's hub models and hub dataset are swapped for a local stand-in built from their shipped
    # config.json (same architecture, vocabulary, special ids, template; small width and depth) and a local
    # dataset shaped like the hub one; nothing else changes (resispec/models/standin.py)
    standin: bool = False
    world: WorldConfig = field(default_factory=WorldConfig)
    target: ModelConfig = field(default_factory=ModelConfig)
    draft: ModelConfig = field(default_factory=lambda: ModelConfig(path="world:draft"))
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    headroom: HeadroomConfig = field(default_factory=HeadroomConfig)


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (called by every entry script before @hydra.main)."""
    ConfigStore.instance().store(name="resispec_schema", node=ResiSpecConfig)


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the repository's Hydra configs (editable install)


def compose_typed(overrides: Sequence[str] = (), config_name: str = "distill") -> ResiSpecConfig:
    """The typed config of `config_name` with Hydra `overrides`, composed from conf/ as the entry scripts compose
    it: for argparse scripts that take Hydra overrides beside their own flags."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_typed(compose(config_name=config_name, overrides=list(overrides)))


def to_typed(cfg) -> ResiSpecConfig:
    """DictConfig -> ResiSpecConfig (typed dataclasses all the way down). With `standin=true` the hub names are
    swapped for the local stand-in (built once and cached)."""
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, ResiSpecConfig), type(obj)
    if obj.standin:
        obj = apply_standin(obj)
    return obj
