"""`+recipe=debug` through Hydra's compose API on the micro world: the real data path (prompts, target
regeneration, packing) feeding distill(), as `python train/distill.py +recipe=debug` runs it."""

from __future__ import annotations

import json
from pathlib import Path

from hydra import compose, initialize_config_dir

from resispec.config import register_configs, to_typed

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_debug_recipe_on_the_micro_world(micro_world, tmp_path):
    from transformers import AutoModelForCausalLM

    from resispec.training import JOB_SECTIONS, DistillJob, distill, format_metrics

    world, _ = micro_world
    register_configs()
    overrides = [
        "+recipe=debug",
        f"world.cache_dir={world.cache_dir}",
        "logger.wandb.mode=disabled",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=4",
        "train.eval_every=4",
        "train.save_every=4",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        c = to_typed(compose(config_name="distill", overrides=overrides))
    assert c.world.name == "micro" and c.train.num_threads == 1
    job = DistillJob(**{k: getattr(c, k) for k in JOB_SECTIONS}, output_dir=c.train.output_dir, name=c.name)
    result = distill(job)
    metrics = json.loads((result.output_dir / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["rule"] == "resispec"
    assert metrics["before"]["num_positions"] == c.train.eval_positions  # 8 prompts x 32 tokens >= 128
    assert 1.0 <= metrics["after"]["tau"]["resispec"] <= 1 + len(c.decode.tree)
    assert "| resispec |" in format_metrics(metrics)
    AutoModelForCausalLM.from_pretrained(result.draft_dir)
