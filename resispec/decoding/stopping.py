"""Stop conditions checked token by token inside an accepted run: EOS ids, stop strings, max_new_tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from resispec.models.eos import model_eos, normalize_eos

__all__ = ["StopChecker", "make_stop_string_checker", "model_eos", "normalize_eos", "stop_checkers"]

StopChecker = Callable[[list[int]], bool]  # generated ids so far (prompt excluded) -> stop now?


def make_stop_string_checker(tokenizer, stop: str | Sequence[str]) -> StopChecker:
    """A checker that fires once the decoded generated text contains any stop string.

    Only a tail window of tokens is decoded (the stop string must end at the newest token, since the checker runs
    after every token), so the cost per token does not grow with the output length. The token that completes the
    stop string is emitted; the server trims the text at the stop string.
    """
    stops = [stop] if isinstance(stop, str) else [s for s in stop if s]
    if not stops:
        return lambda ids: False
    window = max(len(s) for s in stops) + 8  # tokens: every real token decodes to >= 1 character, plus slack

    def check(ids: list[int]) -> bool:
        text = tokenizer.decode(ids[-window:], skip_special_tokens=False)
        return any(s in text for s in stops)

    return check


def stop_checkers(
    tokenizer, stop: str | Sequence[str] | None, stop_checker: StopChecker | None, owner: str
) -> list[StopChecker]:
    """A generation's checkers: `stop_checker`, and for `stop` strings one on the decoded text (needs the
    tokenizer; `owner`, the decoder's class name, is named in the error without one)."""
    checkers = [c for c in (stop_checker,) if c is not None]
    if stop:
        if tokenizer is None:
            raise ValueError(f"stop strings need {owner}(..., tokenizer=...) or a stop_checker")
        checkers.append(make_stop_string_checker(tokenizer, stop))
    return checkers
