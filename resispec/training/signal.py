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


def attach_cache(packed, cache):
    """The packed rows with the cached columns alongside (same row order)."""
    import datasets

    if len(cache) != len(packed):
        raise ValueError(f"target cache has {len(cache)} rows, the packed data {len(packed)}: stale cache")
    return datasets.concatenate_datasets([packed, cache], axis=1).with_format("torch")
