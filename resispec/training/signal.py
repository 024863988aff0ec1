"""The target signal for distillation: `online` (a target forward per batch) or `cached` (the target's top-K
log-probs plus the tail mass, computed once over the packed training set and stored as a datasets dataset)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from resispec.losses import TargetSignal
from resispec.sampling import effective_temperature
from resispec.training.checkpoint import sync_flag

Tensor = torch.Tensor


@torch.no_grad()
def target_logits(target: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Raw target logits [B, T, V] (no grad; the loss applies the decode processing)."""
    return target(input_ids=input_ids, attention_mask=attention_mask).logits


def online_signal(target: torch.nn.Module, batch: dict[str, Tensor]) -> TargetSignal:
    """Dense signal: the target's raw logits over the batch, [B, T, V]."""
    return TargetSignal(target_logits(target, batch["input_ids"], batch["attention_mask"]))


def cached_signal(batch: dict[str, Tensor]) -> TargetSignal:
    """Sparse signal from the cached columns of a batch: top-K log-probs [B, T, K] and ids [B, T, K]."""
    return TargetSignal(batch["topk_logprobs"].float(), batch["topk_ids"].long())


def cache_key(target_path: str, fingerprint: str, top_k: int, temperature: float) -> str:
    """A stable folder name for one (target, packed data, K, temperature) combination."""
    blob = json.dumps([target_path, fingerprint, top_k, effective_temperature(temperature)])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@torch.no_grad()
def build_cache(
    target: torch.nn.Module,
    packed,  # datasets.Dataset with input_ids, attention_mask, loss_mask (torch format)
    path: Path,
    top_k: int,
    temperature: float,
    batch_size: int,
    device: torch.device,
    show_progress: bool = True,
):
    """Run the target once over `packed` and store, per row, its top-K temperature-scaled log-probs [T, K]
    (float16 to halve the disk; the loss works in float32) and ids [T, K] at `path` (written to a temporary
    folder, then renamed, so a crash never leaves a half cache). Returns the dataset (torch format)."""
    import datasets

    if path.exists():
        return datasets.load_from_disk(str(path)).with_format("torch")
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tau = effective_temperature(temperature)

    def rows():
        for start in tqdm(
            range(0, len(packed), batch_size), desc="cache target top-K", disable=not show_progress
        ):
            batch = packed[start : start + batch_size]
            ids = batch["input_ids"].to(device)
            mask = batch["attention_mask"].to(device)
            logprobs = (target_logits(target, ids, mask).float() / tau).log_softmax(-1)  # [B, T, V]
            top = torch.topk(logprobs, min(top_k, logprobs.shape[-1]), dim=-1)  # sorted, most likely first
            for b in range(ids.shape[0]):
                yield {
                    "topk_logprobs": top.values[b].half().cpu().numpy(),
                    "topk_ids": top.indices[b].int().cpu().numpy(),
                }

    ds = datasets.Dataset.from_generator(rows, cache_dir=str(tmp / "_gen"))
    ds.save_to_disk(str(tmp / "data"))
    del ds
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():  # another process may have won the race; its copy is identical
        os.replace(tmp / "data", path)
    shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(str(path)).with_format("torch")


def build_cache_sharded(
    accelerator,
    target: torch.nn.Module,
    packed,
    path: Path,
    top_k: int,
    temperature: float,
    batch_size: int,
    show_progress: bool = True,
):
    """`build_cache` with every process building its contiguous share of the rows (`path`.shard-R-of-P), then the
    main process concatenating the shares in rank order into `path`: the same dataset as one process's build,
    written atomically, with build.json saying who built which rows. Every process returns the loaded cache."""
    import datasets

    if not sync_flag(accelerator, path.exists()):  # the main process decides: the folder may appear meanwhile
        n, world, rank = len(packed), accelerator.num_processes, accelerator.process_index
        bounds = [(r * n // world, (r + 1) * n // world) for r in range(world)]
        shards = [path.with_name(f"{path.name}.shard-{r}-of-{world}") for r in range(world)]
        lo, hi = bounds[rank]
        args = (top_k, temperature, batch_size, accelerator.device)
        if hi > lo:
            build_cache(target, packed.select(range(lo, hi)), shards[rank], *args, show_progress)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process and not path.exists():
            parts = [
                datasets.load_from_disk(str(s)) for s, (a, b) in zip(shards, bounds, strict=True) if b > a
            ]
            merged = datasets.concatenate_datasets(parts)
            tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            merged.save_to_disk(str(tmp))
            build = {"num_processes": world, "rows": n, "rows_by_process": [hi - lo for lo, hi in bounds]}
            (tmp / "build.json").write_text(json.dumps(build))
            del merged
            os.replace(tmp, path)
        if accelerator.is_main_process:
            for shard in shards:
                shutil.rmtree(shard, ignore_errors=True)
        accelerator.wait_for_everyone()
    return datasets.load_from_disk(str(path)).with_format("torch")


def attach_cache(packed, cache):
    """The packed rows with the cached columns alongside (same row order)."""
    import datasets

    if len(cache) != len(packed):
        raise ValueError(f"target cache has {len(cache)} rows, the packed data {len(packed)}: stale cache")
    return datasets.concatenate_datasets([packed, cache], axis=1).with_format("torch")
