"""Per-device memory of a distillation run, before renting GPUs (no weights are loaded):

    python train/memory_plan.py +recipe=llama3 --accelerate_config recipes/accelerate/fsdp.yaml
    python train/memory_plan.py +recipe=llama3 target.path=/path/to/config_dir draft.path=/path/to/other_dir

Hydra overrides pick the recipe (models, dtypes, train.batch_size, data.seq_len, train.target_signal, LoRA);
`--accelerate_config` the sharding and the number of devices (none: one device). The models are built on the meta
device from their config.json: a hub name needs its config cached or reachable, a local folder needs only
config.json. See resispec/training/memory_plan.py for what each row counts.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from hydra import compose, initialize_config_dir

from resispec.config import register_configs, to_typed

CONF = Path(__file__).resolve().parents[1] / "conf"


def main(argv: list[str] | None = None) -> str:
    from resispec.models import resolve_model_path
    from resispec.training.memory_plan import model_shape, plan_memory, sharding_from_accelerate_config

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accelerate_config", default=None, help="recipes/accelerate/<config>.yaml")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +recipe=llama3")
    args = parser.parse_intermixed_args(argv)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        c = to_typed(compose(config_name="distill", overrides=args.overrides))
    lora = c.draft.adapter == "lora"
    target = model_shape(
        resolve_model_path(c.target.path, c.world), trust_remote_code=c.target.trust_remote_code
    )
    draft = model_shape(
        resolve_model_path(c.draft.path, c.world),
        lora_r=c.draft.lora.r if lora else 0,
        lora_targets=tuple(c.draft.lora.target_modules),
        trust_remote_code=c.draft.trust_remote_code,
    )
    plan = plan_memory(
        target,
        draft,
        # the loop passes train.mixed_precision to its Accelerator, which wins over the config file's
        dataclasses.replace(
            sharding_from_accelerate_config(args.accelerate_config), mixed_precision=c.train.mixed_precision
        ),
        target_dtype=c.target.dtype,
        draft_dtype=c.draft.dtype,
        lora=lora,
        batch_size=c.train.batch_size,
        seq_len=c.data.seq_len,
        target_signal=c.train.target_signal,
        cached_top_k=c.train.cached_top_k,
    )
    text = f"recipe {c.name}: target {c.target.path}, draft {c.draft.path}\n\n{plan.format()}"
    print(text)
    return text


if __name__ == "__main__":
    main()
