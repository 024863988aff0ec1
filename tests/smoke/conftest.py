"""Fixtures shared by the server smoke tests (test_server.py, test_server_hostile.py): ONE server subprocess on the
micro world for the whole session, and the same model pair loaded in-process for reference outputs."""

from __future__ import annotations

import os
import sys

import pytest

from tests.smoke.processes import free_port, serving
from tests.smoke.test_server import KEY, MODEL, ROOT, RULE, TREE


@pytest.fixture(scope="session")
def pair(micro_world):
    from resispec.models import load_pair
    from resispec.models.config import ModelConfig

    _, paths = micro_world
    target, draft, tok = load_pair(
        ModelConfig(path=str(paths.target_dir)), ModelConfig(path=str(paths.draft_dir))
    )
    return target, draft, tok


@pytest.fixture(scope="session")
def server(micro_world):
    """Base URL of a server subprocess; always killed at the end (also when startup fails)."""
    _, paths = micro_world
    port = free_port()
    cmd = [
        sys.executable,
        str(ROOT / "serve" / "server.py"),
        f"target.path={paths.target_dir}",
        f"draft.path={paths.draft_dir}",
        f"server.port={port}",
        f"server.api_key={KEY}",
        f"server.model_name={MODEL}",
        f"decode.rule={RULE}",
        f"decode.tree=[{','.join(map(str, TREE))}]",
        "server.speculation=always",  # every step drafts (the spec-decode metrics test needs drafts)
        "server.log_level=warning",
        "hydra.run.dir=" + str(paths.root / "server_run"),
        "logger.wandb.mode=disabled",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESISPEC_API_KEY": ""}
    with serving(cmd, env, port, paths.root / "server.log", timeout_s=90) as url:
        yield url


# ---------------------------------------------------------------- the real recipes' stand-ins (standin=true)

STANDIN_PAIRS = {
    "llama3": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    "qwen3": ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"),
}


@pytest.fixture(scope="session")
def standin_cache(tmp_path_factory):
    """A session cache folder; `standin_built(family)` builds that family's stand-in into it once (~10-30 s on
    2 cores), so every subprocess with `world.cache_dir=<it> standin=true` reuses it."""
    return tmp_path_factory.mktemp("standin_cache")


@pytest.fixture(scope="session")
def standin_built(standin_cache):
    from resispec.models.standin import StandinSpec, ensure_standin

    def build(family: str):
        target, draft = STANDIN_PAIRS[family]
        return ensure_standin(
            StandinSpec(target, draft, "HuggingFaceH4/ultrachat_200k"), standin_cache, False
        )

    return build
