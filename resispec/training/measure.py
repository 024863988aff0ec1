"""The memory plan checked against a real step (train/memory_plan.py --measure, scripts/gpu_check.py): the loop's
own training step on synthetic rows of the plan's shape, its measured peak beside the plan's prediction."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from resispec.models import load_pair
from resispec.training import loop
from resispec.training.memory_plan import GIB, run_plan


def status_kib(key: str) -> int:
    """A line of /proc/self/status in KiB (VmRSS: resident now, VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


class SyntheticRows:
    """Packed-data stand-in of one shape: every row seq_len tokens, the last `response` of them the response."""

    def __init__(self, rows: int, seq_len: int, response: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
        self.loss_mask = torch.zeros(rows, seq_len, dtype=torch.long)
        self.loss_mask[:, seq_len - response :] = 1

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, idx):
        ids = self.ids[idx]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": self.loss_mask[idx]}


def measure_step(job, models: tuple | None = None, steps: int = 1) -> dict:
    """Real distillation steps (the loop's `train_step`: draft forward, online target forward, chunked loss,
    backward, AdamW step) of `job`'s models, loaded from job.target / job.draft or given as (target, draft) on
    their device, on synthetic rows of the plan's shape (train.batch_size rows of data.seq_len tokens, the last
    min(data.regen.max_new_tokens, seq_len - 1) the response). Returns {measured_gib, predicted_gib, plan rows,
    step_s (the last step's), tokens_per_s, ...}. measured: on the CPU (Linux) the process's peak resident memory
    over model load and steps, minus its resident memory before; on CUDA the peak allocated by torch (models
    included: load them after `torch.cuda.reset_peak_memory_stats`) and the peak reserved beside it."""
    torch.set_num_threads(max(1, job.train.num_threads or torch.get_num_threads()))
    # one micro-batch per optimizer step: the peak of a step (the AdamW moments are allocated at the first one)
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, grad_accum=1, max_steps=steps))
    if models is None:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the resident memory now
        base = status_kib("VmRSS")
    accelerator = loop.job_accelerator(job)
    target, draft = load_frozen_pair(job)[:2] if models is None else models
    cuda = accelerator.device.type == "cuda"
    plan = run_plan(job, accelerator, target, draft)
    draft, optimizer, scheduler, _ = loop.prepare_draft(accelerator, job, draft)
    seq = job.data.seq_len
    response = min(job.data.regen.max_new_tokens, seq - 1)
    vocab = min(target.config.vocab_size, draft.config.vocab_size if hasattr(draft, "config") else 10**9)
    packed = SyntheticRows(job.train.batch_size * steps, seq, response, vocab)
    run = SimpleNamespace(
        job=job,
        accelerator=accelerator,
        target=target,
        draft=draft,
        packed=packed,
        optimizer=optimizer,
        scheduler=scheduler,
        state=loop.TrainerState(),
    )
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loop.train_step(run)
        if cuda:
            torch.cuda.synchronize(accelerator.device)
        times.append(time.perf_counter() - t0)
    if cuda:
        measured = torch.cuda.max_memory_allocated(accelerator.device) / GIB
        extra = {"reserved_gib": round(torch.cuda.max_memory_reserved(accelerator.device) / GIB, 3)}
    else:
        measured, extra = (status_kib("VmHWM") - base) / 2**20 if models is None else float("nan"), {}
    tokens = job.train.batch_size * response
    return {
        "measured_gib": round(measured, 3),
        "predicted_gib": round(plan.total / GIB, 3),
        **extra,
        "plan": {n: round(b / GIB, 4) for n, b, _ in plan.rows},
        "step_s": round(times[-1], 3),
        "step_times_s": [round(t, 3) for t in times],
        "tokens_per_s": round(tokens / times[-1], 1),
        "batch_size": job.train.batch_size,
        "seq_len": seq,
        "response_positions": tokens,
        "device": str(accelerator.device),
        "mixed_precision": str(accelerator.mixed_precision),
    }


def load_frozen_pair(job):
    target, draft, tok = load_pair(job.target, job.draft, job.world)
    target.eval().requires_grad_(False)
    return target, draft, tok
