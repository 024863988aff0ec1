"""Prompt sets, target regeneration (on-policy data, cached) and packing with response-only loss masks."""

from resispec.data.config import DataConfig, RegenConfig
from resispec.data.packing import pack, pack_example
from resispec.data.prompts import DataNotFoundError, load_heldout_prompts, load_prompts
from resispec.data.regen import (
    data_cache_dir,
    ensure_regenerated,
    prompt_set_hash,
    regenerate,
    weights_fingerprint,
)

__all__ = [
    "DataConfig",
    "DataNotFoundError",
    "RegenConfig",
    "data_cache_dir",
    "ensure_regenerated",
    "load_heldout_prompts",
    "load_prompts",
    "pack",
    "pack_example",
    "prompt_set_hash",
    "regenerate",
    "weights_fingerprint",
]
