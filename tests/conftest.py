import pytest
import torch

try:  # the shared micro-world fixture (session scoped); see tests/fixtures_world.py
    from tests.fixtures_world import micro_world  # noqa: F401
except ImportError:  # pragma: no cover - only while the world module is being written
    pass


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped without CUDA (they never replace the CPU test of the same logic)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
