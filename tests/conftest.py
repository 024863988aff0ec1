import pytest
import torch

from tests.fixtures_world import micro_world  # noqa: F401  (the shared session-scoped micro world)


@pytest.fixture
def one_thread():
    """Small tensors: one intra-op thread is much faster than two on a loaded 2-core machine (measured ~30x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Decode loops in tests (`while bs.rows: bs.step()`, RowBatch.generate) end when every row has finished. A defect
# that keeps rows alive must fail fast with a message, not spin until the per-test timeout: every batched decoder
# step is counted per decoder object, and a decoder that steps STEPS_WITHOUT_TOKENS times in a row without emitting
# a token, or MAX_STEPS times in all (far above any test's decode: at most a few thousand), raises.
STEPS_WITHOUT_TOKENS = 200
MAX_STEPS = 50_000


class DecodeStepCapError(AssertionError):
    pass


def step_capped(step, counts: dict):
    """`step` of a batched decoder, counted per decoder object in counts (the caps above)."""

    def wrapper(self, *args, **kwargs):
        had_rows = bool(getattr(self, "rows", True))
        emitted = step(self, *args, **kwargs)
        c = counts.setdefault(id(self), [0, 0])
        c[0] += 1
        c[1] = 0 if not had_rows or any(tokens for _, tokens in emitted or ()) else c[1] + 1
        if c[0] > MAX_STEPS or c[1] > STEPS_WITHOUT_TOKENS:
            raise DecodeStepCapError(
                f"{type(self).__name__}: {c[0]} steps, the last {c[1]} without a token (a decode loop that "
                "does not end)"
            )
        return emitted

    return wrapper


@pytest.fixture(autouse=True)
def decode_step_cap(monkeypatch):
    """Caps every batched decoder's step loop (above)."""
    from resispec.decoding.batch_ar import BatchedDecoder
    from resispec.decoding.batch_spec import BatchedSpeculativeDecoder

    counts: dict[int, list[int]] = {}
    for cls in (BatchedDecoder, BatchedSpeculativeDecoder):
        monkeypatch.setattr(cls, "step", step_capped(cls.step, counts))
    yield


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped without CUDA (they never replace the CPU test of the same logic)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
