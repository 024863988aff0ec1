"""Typed config of the headroom tool (Hydra group `headroom`; conf/headroom/default.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HeadroomConfig:
    positions: int = 120  # held-out positions per split
    calibration_positions: int | None = None  # positions of the calibration split; null = `positions`
    candidates: list[str] = field(
        default_factory=lambda: ["gumbel", "rsd", "resispec_wor"]
    )  # auto's distinct rules
    per_window: int = 4  # positions per text window
    window: int = 192  # tokens per window
    min_context: int = 16
    samples: int = 100  # Monte Carlo runs per node (rules without a closed form)
    temperatures: list[float] = field(default_factory=lambda: [1.0, 0.8, 0.6])
    draws: list[int] = field(default_factory=lambda: [2, 4])
    rules: list[str] | None = None  # null = every rule in VERIFIERS
    calibration_split: str = "validation"
    eval_split: str = "test"
    seed: int = 0
    threads: int = 1  # torch threads (1 is fastest for these small ops); 0 = torch's default
    output_dir: str | None = None  # null = the Hydra run folder (outputs/headroom/<name>/<time>/)
