"""Compose every primary config with every recipe through Hydra's API, as the scripts do."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from resispec.config import ResiSpecConfig, register_configs, to_typed

CONF = Path(__file__).resolve().parents[2] / "conf"
PRIMARY = sorted(p.stem for p in CONF.glob("*.yaml") if not p.name.startswith("_"))  # _base.yaml: shared
RECIPES = [None] + sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "recipe")

register_configs()


def _compose(name, overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def test_every_entry_script_has_a_primary_config():
    assert PRIMARY == ["bench", "distill", "generate", "headroom", "pretrain", "serve"]


@pytest.mark.parametrize("primary", PRIMARY)
@pytest.mark.parametrize("recipe", RECIPES)
def test_compose_primary_with_recipe(primary, recipe):
    cfg = to_typed(_compose(primary, [f"+recipe={recipe}"] if recipe else []))
    assert isinstance(cfg, ResiSpecConfig)
    assert cfg.name == (recipe or "tiny")


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes(group):
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        to_typed(_compose("distill", [f"{group}={option}"]))


def test_no_recipe_is_the_tiny_world():
    cfg = to_typed(_compose("distill"))
    assert cfg.world.name == "tiny" and cfg.target.path == "world:target" and cfg.draft.path == "world:draft"


def test_recipe_is_in_no_defaults_list():
    for path in CONF.rglob("*.yaml"):
        text = path.read_text()
        assert "- recipe" not in text and "recipe:" not in text.split("hydra:")[0], path


@pytest.mark.parametrize("override", ["train.max_stepz=3", "decode.rulee=rrs", "nonsense=1"])
def test_misspelled_key_fails_at_compose(override):
    with pytest.raises(ConfigCompositionException):
        _compose("distill", [override])


def test_wrong_type_fails():
    with pytest.raises(Exception, match="max_steps"):
        to_typed(_compose("distill", ["train.max_steps=lots"]))


def test_decode_tree_auto_composes_and_a_bad_tree_is_refused():
    cfg = to_typed(_compose("serve", ["decode.tree=auto"]))
    assert cfg.decode.planned and cfg.decode.fixed_tree == [4, 2, 1, 1]
    assert to_typed(_compose("serve", ["decode.tree=[3,1]"])).decode.tree == [3, 1]
    with pytest.raises(Exception, match="decode.tree"):
        to_typed(_compose("serve", ["decode.tree=wide"]))
