"""Distillation of drafts toward a target: the accelerate loop, checkpoints, held-out alpha / tau evaluation.

`from resispec.training import distill`: loaded lazily, so importing the config schema stays light and
free of import cycles (resispec.losses imports resispec.training.config).
"""

__all__ = ["DistillResult", "EmptyDatasetError", "distill"]


def __getattr__(name: str):
    if name in __all__:
        from resispec.training import loop

        return getattr(loop, name)
    raise AttributeError(name)
