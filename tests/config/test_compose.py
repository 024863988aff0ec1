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


@pytest.fixture(scope="module")
def group_users() -> dict[str, list[str]]:
    """group -> the primary configs that have it (one composition per primary)."""
    composed = {name: _compose(name) for name in PRIMARY}
    return {g: [name for name, cfg in composed.items() if g in cfg] for g in GROUPS}


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes(group, group_users):
    """Every option of every group composes (in a primary config that has the group, distill where it does),
    converts to the typed config, and the values its YAML sets are the ones the composed config holds (an option
    that Hydra silently dropped, or that a later default overrode, fails here)."""
    from omegaconf import OmegaConf

    users = group_users[group]
    assert users, f"no primary config uses the group {group!r}"
    name = "distill" if "distill" in users else users[0]
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        own = OmegaConf.load(CONF / group / f"{option}.yaml")
        own = {k: v for k, v in own.items() if k != "defaults" and not OmegaConf.is_config(v)}
        cfg = _compose(name, [f"{group}={option}"])
        to_typed(cfg)
        for key, value in own.items():
            assert cfg[group][key] == value, (name, group, option, key, cfg[group][key], value)


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
