"""Per-device memory of a distillation run, before renting GPUs (no weights are loaded):

    python train/memory_plan.py +recipe=llama3 --accelerate_config recipes/accelerate/fsdp.yaml
    python train/memory_plan.py +recipe=llama3 target.path=/path/to/config_dir draft.path=/path/to/other_dir
    python train/memory_plan.py +recipe=qwen3 --json                      # one JSON object (per_device_gib, rows)
    python train/memory_plan.py +recipe=llama3 standin=true --measure    # one real step of the stand-in here

Hydra overrides pick the recipe (models, dtypes, train.batch_size, data.seq_len, train.target_signal, LoRA);
`--accelerate_config` the sharding and the number of devices (none: one device). The models are built on the meta
device from their config.json: a hub name with a shipped config.json (resispec/models/hub_configs) uses it, any
other needs its config cached or reachable; a local folder needs only config.json. See
resispec/training/memory_plan.py for what each row counts. `--measure` runs one distillation step of the
configured models on this machine's CPU (use it with standin=true) and prints the measured peak beside the plan's
prediction for the same shapes (measured_gib, predicted_gib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from resispec.config import compose_typed


def main(argv: list[str] | None = None) -> str:
    from resispec.training.memory_plan import model_shape, plan_memory, sharding_from_accelerate_config

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accelerate_config", default=None, help="recipes/accelerate/<config>.yaml")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument(
        "--measure", action="store_true", help="one real step here (standin=true): measured vs plan"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +recipe=llama3")
    args = parser.parse_intermixed_args(argv)
    c = compose_typed(args.overrides)
    if args.measure:
        from resispec.training.loop import JOB_SECTIONS, DistillJob
        from resispec.training.measure import measure_step

        job = DistillJob(**{k: getattr(c, k) for k in JOB_SECTIONS}, output_dir="/dev/null", name=c.name)
        out = {"recipe": c.name, "standin": c.standin, **measure_step(job)}
        text = json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items())
        print(text)
        return text
    lora = c.draft.adapter == "lora"
    target = model_shape(_config_path(c.target.path, c.world), trust_remote_code=c.target.trust_remote_code)
    draft = model_shape(
        _config_path(c.draft.path, c.world),
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
        response_len=c.data.regen.max_new_tokens,
        chunk_size=c.loss.chunk_size,
    )
    if args.json:
        text = json.dumps(
            {
                "recipe": c.name,
                "target": c.target.path,
                "draft": c.draft.path,
                "sharding": plan.sharding.label,
                "num_processes": plan.sharding.num_processes,
                "per_device_gib": round(plan.total / 2**30, 3),
                "rows": {n: round(b / 2**30, 3) for n, b, _ in plan.rows},
            }
        )
        print(text)
        return text
    text = f"recipe {c.name}: target {c.target.path}, draft {c.draft.path}\n\n{plan.format()}"
    print(text)
    return text


def _config_path(path: str, world) -> str:
    """A local path as is; a hub name: its shipped config.json folder when one ships, else the hub name."""
    from resispec.models import resolve_model_path
    from resispec.models.hub_configs import shipped_config_dir

    local = resolve_model_path(path, world)
    if Path(local).expanduser().exists():
        return local
    shipped = shipped_config_dir(path)
    return str(shipped) if shipped is not None else local


if __name__ == "__main__":
    main()
