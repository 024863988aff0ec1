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


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped without CUDA (they never replace the CPU test of the same logic)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
