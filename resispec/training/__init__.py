"""Distillation of drafts toward a target: the accelerate loop, checkpoints, held-out alpha / tau evaluation.

`from resispec.training import distill`: loaded lazily, so importing the config schema stays light and
free of import cycles (resispec.losses imports resispec.training.config).
"""

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


def __getattr__(name: str):
    if name == "format_metrics":
        from resispec.training.evaluation import format_metrics

        return format_metrics
    if name in __all__:
        from resispec.training import loop

        return getattr(loop, name)
    raise AttributeError(name)
