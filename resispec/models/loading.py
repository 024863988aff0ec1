"""Load HF causal LMs and tokenizers by hub name, local path, or `world:target` / `world:draft`.

One clear `ModelNotFoundError` when a model is neither a local folder nor in the HF cache while offline, so entry
scripts can print one line instead of a traceback. Target and draft tokenizers are compared before any weights load.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from resispec.errors import UserError
from resispec.models.config import ModelConfig, WorldConfig
from resispec.models.head import DraftHead, HeadConfigError, is_head_dir
from resispec.models.world import ensure_world

WORLD_PREFIX = "world:"


class ModelNotFoundError(UserError, RuntimeError):
    """A model or tokenizer could not be found locally and could not be downloaded."""


class TokenizerMismatchError(UserError, ValueError):
    """Target and draft do not share a tokenizer (speculative decoding needs the same token ids)."""


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda if available else cpu; anything else is passed to torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype | str:
    """`auto` is passed through to from_pretrained (the checkpoint's dtype); other names are torch dtypes."""
    if name == "auto":
        return "auto"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return dtype


def resolve_model_path(path: str, world: WorldConfig | None = None) -> str:
    """`world:target` / `world:draft` / `world:tokenizer` -> the tiny world's folders (built on first use);
    anything else unchanged."""
    if not path.startswith(WORLD_PREFIX):
        return path

    which = path[len(WORLD_PREFIX) :]
    names = ("target", "draft", "tokenizer")
    if which not in names:  # checked before building anything
        raise ModelNotFoundError(
            f"unknown world model {path!r}; use one of {[WORLD_PREFIX + k for k in names]}"
        )
    paths = ensure_world(world if world is not None else WorldConfig())
    folders = {"target": paths.target_dir, "draft": paths.draft_dir, "tokenizer": paths.tokenizer_dir}
    return str(folders[which])


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _not_found(name: str, cause: BaseException | None = None) -> ModelNotFoundError:
    why = f" ({type(cause).__name__}: {str(cause).splitlines()[0][:200]})" if cause is not None else ""
    return ModelNotFoundError(
        f"model {name!r} is not a local folder and is not in the Hugging Face cache{why}. "
        "Provide it as a local path (target.path=/path/to/checkpoint with config.json, weights and tokenizer), "
        "or put the files in the HF cache (HF_HOME=/path/with/hub/...; HF_HUB_OFFLINE=1 uses only that cache), "
        "or allow downloads (unset HF_HUB_OFFLINE, network access to the hub)."
    )


def _check_available(name: str, revision: str | None = None) -> None:
    """Fail fast (no network attempt) for a hub name that is not cached while offline."""
    if Path(name).expanduser().exists():
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelNotFoundError(f"local model folder {name!r} does not exist")
    if _offline():
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(name, "config.json", revision=revision)
            found_tok = try_to_load_from_cache(name, "tokenizer_config.json", revision=revision)
        except Exception as err:  # invalid repo id, broken cache
            raise _not_found(name, err) from None
        if not isinstance(found, str) and not isinstance(found_tok, str):
            raise _not_found(name)


def load_tokenizer(path_or_cfg: str | ModelConfig, world: WorldConfig | None = None):
    """A fast tokenizer for a hub name, local path or ModelConfig; pad defaults to eos when missing."""
    from transformers import AutoTokenizer

    cfg = path_or_cfg if isinstance(path_or_cfg, ModelConfig) else ModelConfig(path=str(path_or_cfg))
    path = resolve_model_path(cfg.path, world)
    _check_available(path, cfg.revision)
    try:
        tok = AutoTokenizer.from_pretrained(
            path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise _not_found(path, err) from None
    if tok.pad_token_id is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token  # batched generation and packing need a pad id
    return tok


def load_model(cfg: ModelConfig, world: WorldConfig | None = None):
    """Load a causal LM in eval mode with the configured dtype and device."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(cfg.path, world)
    _check_available(path, cfg.revision)
    kwargs: dict = {"dtype": resolve_dtype(cfg.dtype), "revision": cfg.revision}
    if cfg.trust_remote_code:
        kwargs["trust_remote_code"] = True
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as err:
        raise _not_found(path, err) from None
    return model.to(resolve_device(cfg.device)).eval()


def check_same_tokenizer(tok_a, tok_b, names: tuple[str, str] = ("target", "draft")) -> None:
    """Raise TokenizerMismatchError unless both tokenizers map the same strings to the same ids."""
    a, b = names
    if tok_a is tok_b:
        return
    vocab_a, vocab_b = tok_a.get_vocab(), tok_b.get_vocab()
    if vocab_a != vocab_b:
        diff = sorted(set(vocab_a.items()) ^ set(vocab_b.items()))[:5]
        raise TokenizerMismatchError(
            f"the {a} and {b} tokenizers differ ({a}: {len(vocab_a)} tokens, {b}: {len(vocab_b)} tokens; "
            f"e.g. {diff}). Speculative decoding needs a draft with the target's tokenizer "
            "(the same model family, e.g. Llama-3.2-1B for Llama-3.1-8B)."
        )
    if tok_a.eos_token_id != tok_b.eos_token_id:
        raise TokenizerMismatchError(
            f"the {a} and {b} tokenizers share a vocabulary but not the eos token "
            f"({a}: {tok_a.eos_token!r}, {b}: {tok_b.eos_token!r})"
        )


def load_drafter(cfg, target, world=None):
    """The drafter `cfg` names for `target`: a head folder (`DraftHead.from_pretrained`, on the target's device and
    dtype) or a causal LM (load_model)."""
    path = resolve_model_path(cfg.path, world)
    if getattr(cfg, "kind", "model") == "head" or is_head_dir(path):
        if not is_head_dir(path):
            raise HeadConfigError(f"draft.kind=head: {path} is not a head folder (a head run's draft/)")
        return DraftHead.from_pretrained(path, target)
    return load_model(cfg, world)


def load_pair(target: ModelConfig, draft: ModelConfig, world: WorldConfig | None = None):
    """(target model, draft model, tokenizer): the tokenizers are compared before any weights load."""
    tok_t = load_tokenizer(target, world)
    tok_d = load_tokenizer(draft, world)
    check_same_tokenizer(tok_t, tok_d)
    target_model = load_model(target, world)
    return (
        target_model,
        load_drafter(draft, target_model, world),
        tok_t,
    )  # a draft head (draft.kind=head) or an LM
