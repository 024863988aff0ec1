"""Target/draft tokenizer and vocabulary compatibility checks."""

from __future__ import annotations

import torch


class TokenizerMismatchError(ValueError):
    """Target and draft do not share a tokenizer (fallback until resispec.models provides its own)."""


def _local_check(tok_a, tok_b) -> None:
    if tok_a.get_vocab() != tok_b.get_vocab():
        raise TokenizerMismatchError("target and draft tokenizers differ: vocabularies are not identical")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(tok_a, attr, None) != getattr(tok_b, attr, None):
            raise TokenizerMismatchError(f"target and draft tokenizers differ: {attr} is not the same")


def check_tokenizers(tok_target, tok_draft) -> None:
    """Raise a clear error when both tokenizers are given and differ (speculative decoding needs one tokenizer)."""
    if tok_target is None or tok_draft is None:
        return
    try:
        from resispec.models import check_same_tokenizer
    except ImportError:
        check_same_tokenizer = _local_check
    check_same_tokenizer(tok_target, tok_draft)


def resolve_vocab_size(target: torch.nn.Module, draft: torch.nn.Module, tokenizer=None) -> int:
    """The vocabulary both models score. Padded embedding sizes may differ (e.g. 151936 vs 151669 real tokens):
    that is allowed only when the tokenizer's real tokens fit in both, and logits are cut to the smaller size."""
    v_t = target.get_output_embeddings().weight.shape[0]
    v_d = draft.get_output_embeddings().weight.shape[0]
    if v_t == v_d:
        return v_t
    if tokenizer is not None and len(tokenizer) <= min(v_t, v_d):
        return min(v_t, v_d)
    raise TokenizerMismatchError(
        f"target and draft vocab sizes differ ({v_t} vs {v_d}); pass tokenizer= whose length fits both to allow it"
    )
