"""A draft head (draft.kind=head) trained by the distillation loop on the micro pair: the head folder, the fkl and
simulated tau moving the right way, the training-time-test unroll and a reduced vocabulary, resume-free errors,
and the trained head decoding exactly (greedy identity) with every tree kind."""

from __future__ import annotations

import json

import pytest
import torch

from resispec.models.config import HeadConfig, ModelConfig
from resispec.training.config import LossConfig, TrainConfig
from resispec.training.head_step import HeadTrainingError
from tests.smoke.test_distill import pair, run_distill  # noqa: F401 (the micro pair fixture)


def head_cfg(**head) -> ModelConfig:
    return ModelConfig(path="unused", device="cpu", kind="head", head=HeadConfig(**head))


def test_head_trains_and_decodes_exactly(pair, tmp_path):  # noqa: F811
    from resispec.decoding import SpeculativeDecoder
    from resispec.models.head import DraftHead, is_head_dir

    train = TrainConfig(
        num_threads=1, max_steps=8, batch_size=4, eval_every=4, save_every=4, eval_positions=40
    )
    out = tmp_path / "head"
    result = run_distill(pair, out, draft=head_cfg(ttt_steps=2), train=train)
    assert is_head_dir(result.draft_dir)
    metrics = json.loads((out / "metrics.json").read_text())
    before, after = metrics["before"], metrics["after"]
    assert after["fkl"] < before["fkl"], (before["fkl"], after["fkl"])
    assert len(metrics["losses"]) == 8 and all(v == v for v in metrics["losses"])

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    head = DraftHead.from_pretrained(result.draft_dir, target)
    prompt = torch.tensor([pair[2][1][0]["prompt_ids"]])
    for tree in ([1, 1, 1], [2, 2, 1]):
        dec = SpeculativeDecoder(target, head, rule="resispec", tree=tree)
        ar = dec.generate_autoregressive(prompt, max_new_tokens=20, temperature=0, eos_token_id=[]).sequences
        spec = dec.generate(prompt, max_new_tokens=20, temperature=0, eos_token_id=[]).sequences
        assert torch.equal(ar, spec), tree


def test_head_reduced_vocab_and_residual_loss(pair, tmp_path):  # noqa: F811
    train = TrainConfig(
        num_threads=1, max_steps=2, batch_size=4, eval_every=2, save_every=2, eval_positions=30
    )
    loss = LossConfig(name="fkl_residual")
    result = run_distill(pair, tmp_path / "h", draft=head_cfg(draft_vocab_size=24), train=train, loss=loss)
    from safetensors.torch import load_file

    state = load_file(str(result.draft_dir / "model.safetensors"))
    assert state["lm_head.weight"].shape[0] == 24 and state["d2t"].shape == (24,)
    assert int(state["t2d"].sum()) == 24


def test_head_refuses_cached_signal(pair, tmp_path):  # noqa: F811
    train = TrainConfig(num_threads=1, max_steps=1, target_signal="cached")
    with pytest.raises(HeadTrainingError, match="online"):
        run_distill(pair, tmp_path / "x", draft=head_cfg(), train=train)
