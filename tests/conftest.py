import pytest
import torch

from tests.fixtures_world import micro_world  # noqa: F401  (the shared session-scoped micro world)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped without CUDA (they never replace the CPU test of the same logic)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
