"""The test suite's decode-step cap (tests/conftest.py): a decode loop that never ends fails fast with a message."""

from __future__ import annotations

import pytest

from tests.conftest import STEPS_WITHOUT_TOKENS, DecodeStepCapError, step_capped


class _Stuck:
    """A decoder whose rows never finish and whose steps emit nothing."""

    rows = [object()]

    def step(self):
        return []


def test_a_decode_loop_that_never_ends_is_stopped():
    step = step_capped(_Stuck.step, {})
    stuck = _Stuck()
    with pytest.raises(DecodeStepCapError, match="without a token"):
        for _ in range(10 * STEPS_WITHOUT_TOKENS):  # the plant: `while stuck.rows: stuck.step()`
            step(stuck)


def test_the_cap_is_on_every_batched_decoder():
    from resispec.decoding.batch_ar import BatchedDecoder
    from resispec.decoding.batch_spec import BatchedSpeculativeDecoder

    for cls in (BatchedDecoder, BatchedSpeculativeDecoder):
        assert cls.step.__qualname__.startswith("step_capped"), cls
