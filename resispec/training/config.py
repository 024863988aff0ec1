"""Typed config for distillation (Hydra groups `loss`, `optim`, `train`, `logger`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LossConfig:
    """`name`: fkl | rkl | jsd | tvd | residual | lk | fkl_residual. The residual loss is 1 - alpha_rule(p, q, n)
    with rule and n from the decode config (`rule: null` = decode.rule); `form` picks the plain, -log or
    fkl-hybrid variant. `lk`: the LK losses (form lambda | log | log_lambda, blend rate lk_eta). `fkl_residual`:
    fkl weighted per position by 1 - alpha_rule (rule and draws as for residual)."""

    name: str = "residual"
    rule: str | None = None
    form: str = (
        "hybrid"  # plain (1 - alpha) | log (-log alpha) | hybrid (1 - alpha + fkl_weight * fkl) | log_hybrid
    )
    num_draws: int | None = None  # n for alpha_rule(p, q, n); null = decode.tree[0] (the root's branching)
    draws: str = "root"  # root: alpha at n = num_draws | tree: mean of alpha(n_d) over the tree's depths d
    # | reach: depth d weighted by d tau / d alpha_d at the batch's acceptances
    fkl_weight: float = 0.1
    jsd_beta: float = 0.5
    depth_decay: float = (
        1.0  # position t of a response weighs depth_decay ** (t mod len(tree)); with draws=tree
    )
    # depth d of the tree weighs depth_decay ** d instead (positions then all weigh 1); 1 = off
    lk_eta: float = 3.0  # lk: lambda = exp(-lk_eta * alpha) blends KL (small alpha) into the acceptance term


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | constant
    grad_clip: float = 1.0


@dataclass
class TrainConfig:
    max_steps: int = 150
    batch_size: int = 8
    grad_accum: int = 1
    target_signal: str = "online"  # online | cached (top-K target log-probs + tail mass)
    cached_top_k: int = 64
    eval_every: int = 50
    save_every: int = 50
    keep_checkpoints: int = 2
    resume: bool = False
    seed: int = 0
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate)
    output_dir: str | None = None  # default: the Hydra run folder
    eval_positions: int = 1024  # held-out positions for alpha / tau
    num_threads: int | None = None  # torch CPU threads during the run; None = torch's default (all cores)


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
