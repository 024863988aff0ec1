"""Distillation of drafts toward a target: the accelerate loop, checkpoints, held-out alpha / tau evaluation.
The entry points: `from resispec.training import DistillJob, distill`."""

from resispec.training.evaluation import format_metrics
from resispec.training.loop import (
    JOB_SECTIONS,
    USER_ERRORS,
    DistillConfigError,
    DistillJob,
    DistillResult,
    EmptyDatasetError,
    LaunchError,
    distill,
)

__all__ = [
    "USER_ERRORS",
    "JOB_SECTIONS",
    "DistillConfigError",
    "DistillJob",
    "DistillResult",
    "EmptyDatasetError",
    "LaunchError",
    "distill",
    "format_metrics",
]
