"""Target/draft tokenizer and vocabulary compatibility checks."""

from __future__ import annotations

import torch

from resispec.models.loading import TokenizerMismatchError, check_same_tokenizer

__all__ = ["TokenizerMismatchError", "check_tokenizers", "resolve_vocab_size"]


def check_tokenizers(tok_target, tok_draft) -> None:
    """Raise TokenizerMismatchError when both tokenizers are given and differ (one tokenizer is required)."""
    if tok_target is None or tok_draft is None:
        return
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
