"""Target regeneration: the target's responses to the train and eval prompt sets (on-policy data), cached.

python train/generate.py                        # the tiny world's target on stdlib prompts
python train/generate.py +recipe=debug          # micro world, a few prompts
accelerate launch train/generate.py +recipe=llama3   # prompts split across processes
python train/generate.py data.regen.engine=vllm     # vLLM offline API (scripts/setup_vllm.sh venv): one engine
                                                    # per GPU, started before any HF weights load
"""

from __future__ import annotations

import time

import hydra
from omegaconf import DictConfig

from resispec.config import register_configs, to_typed
from resispec.errors import exit_on_user_error

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    generate(to_typed(cfg))


def generate(c) -> None:
    """Regenerate the train and eval splits of the typed config `c` (cached). data.regen.engine=vllm: vLLM starts
    before any HF weights load, once (the main process, one engine per GPU), while the other processes wait for
    it within train.process_group_timeout_min; no HF copy of the target is loaded at all."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from resispec.data import data_cache_dir, ensure_regenerated
    from resispec.models import load_model, load_tokenizer, resolve_device, resolve_model_path

    timeout = InitProcessGroupKwargs(timeout=timedelta(minutes=c.train.process_group_timeout_min))
    accelerator = Accelerator(cpu=resolve_device(c.target.device).type == "cpu", kwargs_handlers=[timeout])
    target_id = resolve_model_path(c.target.path, c.world)
    tokenizer = load_tokenizer(c.target, c.world)
    target = None
    if c.data.regen.engine != "vllm":
        target = load_model(c.target, c.world)
        if accelerator.num_processes > 1 and target.device.type != "cpu":
            target.to(accelerator.device)
    for split in ("train", "eval"):
        start = time.perf_counter()
        rows = ensure_regenerated(
            c.data, target, tokenizer, split, c.world, accelerator, target_id, model_dir=target_id
        )
        tokens = sum(len(r) for r in rows["response_ids"])
        accelerator.print(
            f"{split}: {len(rows)} prompts, {tokens} response tokens, {time.perf_counter() - start:.1f}s "
            f"(cache: {data_cache_dir(c.data, c.world)})"
        )


if __name__ == "__main__":
    main()
