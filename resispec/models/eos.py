"""A model's end-of-sequence ids: what stops decoding (resispec.decoding.stopping) and ends a regenerated response
(resispec.data.regen)."""

from __future__ import annotations

from collections.abc import Sequence


def normalize_eos(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(t) for t in eos_token_id)


def model_eos(model) -> int | list[int] | None:
    """The EOS id(s) of a model's generation_config (None when it has none)."""
    return getattr(getattr(model, "generation_config", None), "eos_token_id", None)
