"""Launch checks of the distillation loop (resispec/training/distributed.py) and the shipped accelerate configs.

The 2-process FSDP runs themselves are in tests/smoke/test_distill_fsdp.py (slow); these are the fast guards: a
launch that silently fell back to one process or lost its FSDP / DeepSpeed plugin is refused, and every config
under recipes/accelerate parses with accelerate's own parser and carries the options the recipes rely on.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from resispec.training import USER_ERRORS
from resispec.training.config import OptimConfig
from resispec.training.distributed import LaunchError, check_launch

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"
LAUNCH_ENV = (
    "ACCELERATE_USE_CPU",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
)


def _acc(num_processes: int, kind: DistributedType):
    return SimpleNamespace(num_processes=num_processes, distributed_type=kind)


@pytest.fixture
def clean_env(monkeypatch):
    for k in LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_accelerate_cpu_flag_falling_back_to_one_process_is_refused(clean_env):
    """`accelerate launch --cpu --num_processes 2` runs one process with this environment (measured)."""
    for k, v in (("ACCELERATE_USE_CPU", "True"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        clean_env.setenv(k, v)
    with pytest.raises(LaunchError, match="started ONE"):
        check_launch(_acc(1, DistributedType.NO), fsdp=False, deepspeed=False)
    assert LaunchError in USER_ERRORS  # the entry scripts print it as one line and exit 2


def test_plain_launches_pass(clean_env):
    check_launch(_acc(1, DistributedType.NO), fsdp=False, deepspeed=False)  # python train/distill.py
    clean_env.setenv("ACCELERATE_USE_CPU", "True")  # accelerate launch --cpu, one process asked for
    check_launch(_acc(1, DistributedType.NO), fsdp=False, deepspeed=False)
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("WORLD_SIZE", "2")  # torchrun / accelerate's multi-process launcher
    check_launch(_acc(2, DistributedType.MULTI_CPU), fsdp=False, deepspeed=False)
    check_launch(_acc(2, DistributedType.FSDP), fsdp=True, deepspeed=False)


@pytest.mark.parametrize(
    "fsdp, deepspeed, kind",
    [(True, False, DistributedType.MULTI_CPU), (False, True, DistributedType.MULTI_GPU)],
)
def test_a_sharding_plugin_that_did_not_take_is_refused(clean_env, fsdp, deepspeed, kind):
    with pytest.raises(LaunchError, match="refusing|needs GPUs"):
        check_launch(_acc(2, kind), fsdp=fsdp, deepspeed=deepspeed)


def _load(name: str):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(CONFIGS / name))


@pytest.mark.parametrize("name, stage", [("deepspeed_zero2.yaml", 2), ("deepspeed_zero3.yaml", 3)])
def test_deepspeed_configs_parse_with_the_recipes_options(name, stage):
    cfg = _load(name)
    assert cfg.distributed_type == DistributedType.DEEPSPEED
    ds = cfg.deepspeed_config
    assert ds["zero_stage"] == stage and ds["zero3_init_flag"] is False
    assert ds["gradient_clipping"] == OptimConfig().grad_clip  # DeepSpeed clips inside its engine
    assert ds["offload_optimizer_device"] == ds["offload_param_device"] == "none"
    if stage == 3:
        assert ds["zero3_save_16bit_model"] is True  # the exported draft is gathered from 16-bit weights
    assert str(cfg.mixed_precision) in ("bf16", "PrecisionType.BF16")


@pytest.mark.parametrize("name", ["fsdp.yaml", "fsdp_cpu.yaml"])
def test_fsdp_configs_parse_and_avoid_the_known_traps(name):
    cfg = _load(name)
    assert cfg.distributed_type == DistributedType.FSDP
    fsdp = cfg.fsdp_config
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"  # the checkpoint format the README documents
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp  # from _no_split_modules; a fixed list fails
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is False  # else the unwrapped target is empty on ranks > 0
    if name == "fsdp_cpu.yaml":
        assert cfg.use_cpu and cfg.num_processes == 2 and fsdp["fsdp_sync_module_states"] is False


def test_every_shipped_config_parses():
    names = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert {"fsdp.yaml", "fsdp_cpu.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"} <= set(names)
    for name in names:
        _load(name)
