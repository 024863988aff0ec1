"""decode.tree=auto end to end on the micro world: the server plans its tree per batch-size bucket at start-up
(cost model, calibration on the data's eval split, the batch-1 plan settled on real decodes of those prompts),
serves with it, and the greedy output is still the target's own greedy output."""

from __future__ import annotations

import re

import pytest
import torch

from resispec.data.config import DataConfig
from resispec.decoding import SpeculativeDecoder
from resispec.decoding.config import DecodeConfig
from resispec.decoding.planner import candidate_trees
from resispec.errors import UserError
from resispec.models.config import ModelConfig
from resispec.serving.config import ServerConfig
from resispec.serving.server import build_app, build_engine
from resispec.serving.text import decode_ids, encode_text
from tests.unit.test_decoding_helpers import single_thread


@pytest.fixture(scope="module")
def paths(micro_world):
    return micro_world


def test_server_plans_its_tree_and_stays_exact(paths, capsys):
    from fastapi.testclient import TestClient

    world, wp = paths
    decode = DecodeConfig(rule="resispec", tree="auto", temperature=0.0, plan_prompts=2)
    with single_thread():
        app = build_app(
            ServerConfig(model_name="m", max_batch_size=4),
            decode,
            ModelConfig(path=str(wp.target_dir)),
            ModelConfig(path=str(wp.draft_dir)),
            world,
            DataConfig(),
        )
        printed = capsys.readouterr().out  # each batch size's choice is printed with its prediction
        # greedy rows planned at T = 0, sampled rows at T = 1 (decode's temperature is 0)
        for t in (0, 1):
            assert all(f"tree=auto (resispec, T={t}, batch {b})" in printed for b in (1, 2, 4)), printed
        # batch 1 is settled on real decodes of the calibration prompts, a chain among the candidates
        ones = [line for line in printed.splitlines() if "batch 1)" in line]
        assert len(ones) == 2 and all("measured on calibration" in line for line in ones), printed
        assert all(re.search(r"decoded .*\[1(, 1)*\] \d", line) for line in ones), printed
        engine = app.state.server.worker.engine
        assert sorted(engine.trees_by_batch) == sorted(engine.greedy_trees_by_batch) == [1, 2, 4]
        assert list(engine.decoder.shape) == engine.greedy_trees_by_batch[1]  # decode's temperature: 0
        with TestClient(app) as client:
            body = {"model": "m", "prompt": "def main():\n", "max_tokens": 12, "temperature": 0}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
    assert list(engine.decoder.shape) in candidate_trees(max_branch=4)
    # the same request through target greedy decoding
    from resispec.models import load_pair

    target, draft, tok = load_pair(ModelConfig(path=str(wp.target_dir)), ModelConfig(path=str(wp.draft_dir)))
    ids = torch.tensor([encode_text(tok, "def main():\n")])
    ar = SpeculativeDecoder(target, draft, rule="chain", tree=[1], tokenizer=tok)
    ref = ar.generate_autoregressive(ids, max_new_tokens=12, temperature=0.0).sequences[0, ids.shape[1] :]
    assert text == decode_ids(tok, ref.tolist())


def test_tree_auto_without_calibration_prompts_is_a_clear_error(paths):
    from resispec.models import load_pair

    _, wp = paths
    target, draft, tok = load_pair(ModelConfig(path=str(wp.target_dir)), ModelConfig(path=str(wp.draft_dir)))
    with pytest.raises(UserError, match="calibration prompts"):
        build_engine(target, draft, tok, DecodeConfig(tree="auto"), plan_prompts=None)
