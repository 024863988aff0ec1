"""Model loading (HF hub names, local paths, the embedded tiny world), the tiny Llama factory and tokenizer."""

from resispec.models.config import LoraConfig, ModelConfig, PretrainConfig, SizeConfig, WorldConfig
from resispec.models.factory import make_llama, train_bpe_tokenizer
from resispec.models.loading import (
    ModelNotFoundError,
    TokenizerMismatchError,
    check_same_tokenizer,
    load_drafter,
    load_model,
    load_pair,
    load_tokenizer,
    resolve_device,
    resolve_model_path,
)
from resispec.models.world import (
    WorldPaths,
    cache_root,
    config_hash,
    ensure_world,
    format_report,
    load_world,
    remeasure_speed,
    stdlib_splits,
)

__all__ = [
    "LoraConfig",
    "ModelConfig",
    "ModelNotFoundError",
    "PretrainConfig",
    "SizeConfig",
    "TokenizerMismatchError",
    "WorldConfig",
    "WorldPaths",
    "cache_root",
    "check_same_tokenizer",
    "config_hash",
    "ensure_world",
    "format_report",
    "load_drafter",
    "load_model",
    "load_pair",
    "load_tokenizer",
    "load_world",
    "make_llama",
    "remeasure_speed",
    "resolve_device",
    "resolve_model_path",
    "stdlib_splits",
    "train_bpe_tokenizer",
]
