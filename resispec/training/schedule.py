"""The run's length and cadences in optimizer steps, resolved once the packed training rows and the number of
processes are known: `train.epochs` (passes over the packed rows) sets the length so that adding GPUs shortens
the run instead of silently multiplying its epochs; `train.max_steps` caps it (or sets it alone)."""

from __future__ import annotations

import dataclasses
import math

from resispec.errors import UserError
from resispec.training.config import OptimConfig, TrainConfig


class ScheduleError(UserError, ValueError):
    """The run's length cannot be resolved (neither epochs nor max_steps, or a non-positive value)."""


def resolve_schedule(
    train: TrainConfig, optim: OptimConfig, num_rows: int, num_processes: int
) -> tuple[TrainConfig, OptimConfig, str]:
    """(train with max_steps / eval_every / save_every in steps, optim with warmup_steps in steps, a one-line
    description). One optimizer step reads batch_size x grad_accum rows on each of the num_processes."""
    rows_per_step = train.batch_size * max(1, train.grad_accum) * max(1, num_processes)
    if train.epochs is None and train.max_steps is None:
        raise ScheduleError(
            "set the run length: train.epochs (passes over the training rows) or train.max_steps"
        )
    if train.epochs is not None and train.epochs <= 0:
        raise ScheduleError(f"train.epochs must be > 0, got {train.epochs}")
    steps = train.max_steps
    if train.epochs is not None:
        by_epochs = max(1, math.ceil(train.epochs * num_rows / rows_per_step))
        steps = by_epochs if steps is None else min(steps, by_epochs)
    eval_every = max(1, math.ceil(steps / train.num_evals)) if train.num_evals else train.eval_every
    save_every = eval_every if train.save_every is None else train.save_every
    warmup = max(optim.warmup_steps, round(optim.warmup_ratio * steps))
    epochs = steps * rows_per_step / max(1, num_rows)
    text = (
        f"{steps} steps x {rows_per_step} rows ({train.batch_size} x {max(1, train.grad_accum)} accumulated x "
        f"{max(1, num_processes)} processes) = {epochs:.2f} epochs of {num_rows} rows; evaluate every "
        f"{eval_every}, save every {save_every}, warmup {warmup}"
    )
    return (
        dataclasses.replace(train, max_steps=steps, eval_every=eval_every, save_every=save_every),
        dataclasses.replace(optim, warmup_steps=warmup),
        text,
    )
