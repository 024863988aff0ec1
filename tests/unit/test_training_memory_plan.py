"""The memory plan (resispec/training/memory_plan.py, train/memory_plan.py): exact parameter counts from a
config.json alone on the meta device, the sharding arithmetic of each shipped accelerate config, and agreement
with accelerate's own estimate (`accelerate estimate-memory`) where both count the same thing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from resispec.training.memory_plan import model_shape, plan_memory, sharding_from_accelerate_config
from tests.unit.test_training_helpers import make_micro_llama

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "recipes" / "accelerate"
LLAMA = ROOT / "resispec" / "models" / "hub_configs" / "meta-llama"


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """(a folder holding only a micro draft's config.json, that draft's real parameter count)."""
    root = tmp_path_factory.mktemp("cfg")
    model = make_micro_llama(1, 16, 1)
    model.save_pretrained(root / "full")
    (root / "config_only").mkdir()
    shutil.copy(root / "full" / "config.json", root / "config_only" / "config.json")
    return str(root / "config_only"), sum(p.numel() for p in model.parameters())


def _plan(shape, config, **kw):
    opts = dict(
        target_dtype="bfloat16",
        draft_dtype="bfloat16",
        lora=False,
        batch_size=2,
        seq_len=16,
        target_signal="online",
        cached_top_k=8,
    )
    opts.update(kw)
    return plan_memory(shape, shape, sharding_from_accelerate_config(config), **opts)


def test_counts_come_from_config_json_alone(config_only):
    path, real = config_only
    shape = model_shape(path)
    assert shape.params == real and shape.hidden == 16 and shape.layers == 1
    lora = model_shape(path, lora_r=4, lora_targets=("q_proj", "v_proj"))
    assert lora.lora_params == 4 * ((16 + 16) + (16 + 16))  # q: 16 -> 16, v: 16 -> 2 heads x 8 (MHA here)


def test_agrees_with_accelerate_estimate_memory_on_one_device(config_only):
    """accelerate's "Training using Adam" (float32) is 4 x the float32 model: weights + grads + 2 Adam moments.
    The plan's draft rows on one device are the same 16 bytes per parameter (buffers are not trained)."""
    import torch
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoConfig, AutoModelForCausalLM

    path, _ = config_only
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    total, _ = calculate_maximum_sizes(meta)
    theirs = max(estimate_training_usage(total, "float32").values())
    buffers = sum(
        b.numel() * 4 for b in meta.buffers()
    )  # accelerate also counts buffers (rotary inv_freq) x 4
    plan = _plan(model_shape(path), None)
    assert (
        plan.row("draft weights") + plan.row("gradients") + plan.row("optimizer state")
        == theirs - 4 * buffers
    )


@pytest.mark.parametrize(
    "config, weights, grads, optim",
    [
        (None, 1, 1, 1),
        ("multi_gpu.yaml", 1, 1, 1),  # DDP replicates everything
        ("deepspeed_zero2.yaml", 1, 8, 8),
        ("deepspeed_zero3.yaml", 8, 8, 8),
        ("fsdp.yaml", 8, 8, 8),  # FULL_SHARD
        ("fsdp_cpu.yaml", 2, 2, 2),
    ],
)
def test_sharding_divides_what_each_config_shards(config_only, config, weights, grads, optim):
    shape = model_shape(config_only[0])
    one = _plan(shape, None)
    plan = _plan(shape, CONFIGS / config if config else None)
    for row, div in (("draft weights", weights), ("gradients", grads), ("optimizer state", optim)):
        assert plan.row(row) == -(-one.row(row) // div), row
    assert plan.row("target weights") == one.row("target weights") == shape.params * 2  # never sharded
    if plan.sharding.mixed_precision == "no":  # the per-process batch: activations do not shrink with P
        assert plan.row("activations") == one.row("activations")


def test_cached_targets_drop_the_target_and_add_the_top_k_batch(config_only):
    shape = model_shape(config_only[0])
    online, cached = _plan(shape, None), _plan(shape, None, target_signal="cached")
    assert cached.row("target weights") == 0 and cached.row("cached top-K batch") == 2 * 16 * 8 * 12
    assert cached.row("activations") < online.row("activations")


def test_the_command_on_the_shipped_llama3_configs():
    """No weights, no hub: the recipe's models from the config.json files shipped beside the recipe."""
    import sys

    sys.path.insert(0, str(ROOT / "train"))
    try:
        from memory_plan import main
    finally:
        sys.path.pop(0)
    text = main(
        [
            "--accelerate_config",
            str(CONFIGS / "fsdp.yaml"),
            "+recipe=llama3",
            f"target.path={LLAMA / 'Llama-3.1-8B-Instruct'}",
            f"draft.path={LLAMA / 'Llama-3.2-1B-Instruct'}",
        ]
    )
    assert "FSDP FULL_SHARD x8" in text and "8.03B params in bfloat16" in text and "1.236B params" in text
