"""Shared pytest fixture: the micro world (conf/world/micro.yaml), built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from resispec.models.config import WorldConfig

MICRO_YAML = Path(__file__).resolve().parents[1] / "conf" / "world" / "micro.yaml"


def micro_world_config(cache_dir: str | Path | None = None) -> WorldConfig:
    """WorldConfig with the values of conf/world/micro.yaml (the same schema Hydra composes)."""
    merged = OmegaConf.merge(OmegaConf.structured(WorldConfig), OmegaConf.load(MICRO_YAML))
    world = OmegaConf.to_object(merged)
    assert isinstance(world, WorldConfig)
    if cache_dir is not None:
        world.cache_dir = str(cache_dir)
    return world


@pytest.fixture(scope="session")
def micro_world(tmp_path_factory):
    """(WorldConfig, WorldPaths) of the micro world, built into a session temp folder (tens of seconds on 2 cores)."""
    from resispec.models import ensure_world

    world = micro_world_config(tmp_path_factory.mktemp("resispec_cache"))
    return world, ensure_world(world, progress=False)


def micro_models(paths):
    """(tokenizer, target, draft) of a built micro world (its WorldPaths), in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths.tokenizer_dir)
    target = AutoModelForCausalLM.from_pretrained(paths.target_dir).eval()
    return tok, target, AutoModelForCausalLM.from_pretrained(paths.draft_dir).eval()
