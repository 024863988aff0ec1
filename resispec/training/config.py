"""Typed config for distillation (Hydra groups `optim`, `train`, `logger`; the `loss` group's LossConfig lives with the
losses in resispec/losses.py and is re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from resispec.losses import LossConfig

__all__ = ["LoggerConfig", "LossConfig", "OptimConfig", "TrainConfig"]


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    warmup_ratio: float = 0.0  # warmup = max(warmup_steps, this fraction of the run's steps)
    schedule: str = "cosine"  # cosine | constant
    grad_clip: float = 1.0


@dataclass
class TrainConfig:
    # run length: train.epochs (passes over the packed training rows, any number of processes) and/or max_steps
    # (a cap, or the length alone); resolved in resispec/training/schedule.py
    max_steps: int | None = 150
    epochs: float | None = None
    batch_size: int = 8
    grad_accum: int = 1
    target_signal: str = "online"  # online | cached (top-K target log-probs + tail mass)
    cached_top_k: int = 64
    eval_every: int = 50
    num_evals: int | None = None  # evaluations over the run (evenly spaced): overrides eval_every
    save_every: int | None = 50  # None: with every evaluation
    keep_checkpoints: int = 2
    resume: bool = False
    seed: int = 0
    # no | bf16 | fp16 (accelerate) | auto (bf16 where the device multiplies bf16 natively, else no). The draft's
    # forward and the online target's forward run under it; weights and the loss stay float32
    mixed_precision: str = "no"
    output_dir: str | None = None  # default: the Hydra run folder
    eval_positions: int = 1024  # held-out positions for alpha / tau (sharded over the processes)
    num_threads: int | None = None  # torch CPU threads during the run; None = torch's default (all cores)
    force_memory: bool = False  # start on a GPU even when the memory plan exceeds its memory
    # collective timeout of the process group, minutes: the other ranks wait this long for the slowest one's share
    # of regeneration or of the cached target build (torch's NCCL default of 10 min kills a real recipe's run)
    process_group_timeout_min: float = 120.0


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "resispec"
    entity: str | None = None
    dir: str | None = None  # default: the run's output folder


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    log_every: int = 10
