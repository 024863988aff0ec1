"""The draft head's vLLM eagle3 export (resispec/models/head_export.py): the EAGLE / SpecForge layout vLLM loads
(keys, shapes, dtypes, config fields, norm_before_residual written explicitly) and the one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from resispec.models.export import ExportError
from resispec.models.head import DraftHead
from resispec.models.head_export import export_head
from tests.unit.test_decoding_helpers import micro_llama

VOCAB = 48


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from tests.unit.test_training_helpers import make_tokenizer

    root = tmp_path_factory.mktemp("eagle3")
    target = micro_llama(64, 8, VOCAB, seed=0, num_attention_heads=2, num_key_value_heads=1)
    target.save_pretrained(root / "target")
    make_tokenizer().save_pretrained(root / "target")
    return root, target


def test_export_writes_the_eagle3_layout(target_dir, tmp_path):
    root, target = target_dir
    counts = torch.arange(VOCAB, dtype=torch.float64)
    head = DraftHead.from_target(target, draft_vocab_size=20, token_counts=counts)
    head.save_pretrained(tmp_path / "head")
    res = export_head(tmp_path / "head", str(root / "target"), tmp_path / "out", backend="vllm-cpu", k=3)
    cfg = json.loads((res.out_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (
        cfg["norm_before_residual"] is False and cfg["vocab_size"] == VOCAB and cfg["draft_vocab_size"] == 20
    )
    assert (
        cfg["eagle_aux_hidden_state_layer_ids"]
        == [2, 4, 5]
        == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    assert cfg["target_hidden_size"] == 64 and cfg["rope_theta"] > 0 and cfg["max_position_embeddings"] == 256
    state = load_file(str(res.out_dir / "model.safetensors"))
    assert state["fc.weight"].shape == (64, 3 * 64)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert state["midlayer.self_attn.k_proj.weight"].shape == (32, 128)  # GQA as the target's
    for key in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "norm.weight"):
        assert key in state
    assert state["lm_head.weight"].shape == (20, 64) and "embed_tokens.weight" not in state
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert (state["d2t"] + torch.arange(20)).tolist() == list(range(28, 48))
    assert '"method": "eagle3"' in res.commands["vllm"] and (res.out_dir / "tokenizer.json").exists()


def test_a_full_vocabulary_head_is_exported_without_an_id_map(target_dir, tmp_path):
    """The head's vocabulary is the target's: no d2t / t2d in the export. vLLM (0.32) builds no
    draft_id_to_target_id for it and refuses to load a d2t ("There is no module or parameter named
    'draft_id_to_target_id' in Eagle3LlamaForCausalLM")."""
    root, target = target_dir
    DraftHead.from_target(target).save_pretrained(tmp_path / "head")
    res = export_head(tmp_path / "head", str(root / "target"), tmp_path / "out", backend="vllm-cpu", k=2)
    state = load_file(str(res.out_dir / "model.safetensors"))
    assert "d2t" not in state and "t2d" not in state and state["lm_head.weight"].shape == (VOCAB, 64)
    cfg = json.loads((res.out_dir / "config.json").read_text())
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == VOCAB


def test_export_refuses_a_head_vllm_cannot_load(target_dir, tmp_path):
    root, target = target_dir
    DraftHead.from_target(target, layers=[1, 6]).save_pretrained(tmp_path / "two")
    with pytest.raises(ExportError, match="exactly 3"):
        export_head(tmp_path / "two", str(root / "target"), tmp_path / "o", backend="vllm-cpu")
    DraftHead.from_target(target, layers=[6, 1, 3]).save_pretrained(tmp_path / "unsorted")
    with pytest.raises(ExportError, match="sorted"):
        export_head(tmp_path / "unsorted", str(root / "target"), tmp_path / "o", backend="vllm-cpu")
    other = micro_llama(32, 8, VOCAB, seed=1)
    DraftHead.from_target(other).save_pretrained(tmp_path / "other")
    with pytest.raises(ExportError, match="trained for a target"):
        export_head(tmp_path / "other", str(root / "target"), tmp_path / "o", backend="vllm-cpu")
    assert not (tmp_path / "o").exists()


@pytest.mark.vllm
def test_vllm_eagle3_loads_the_export_and_keeps_greedy_tokens(target_dir, tmp_path):
    """vLLM (the isolated venv) serves the target with the exported head as its `eagle3` drafter: greedy tokens
    equal ours. Where vllm-cpu cannot run eagle3, the failure's last lines say why (the format test above stays)."""
    from resispec.decoding import SpeculativeDecoder
    from resispec.vllm_venv import offline_generate, vllm_version
    from tests.unit.test_training_helpers import make_tokenizer

    if vllm_version() is None:
        pytest.skip("no vLLM venv (scripts/setup_vllm.sh)")
    root, target = target_dir
    DraftHead.from_target(target).save_pretrained(tmp_path / "head")
    out = export_head(tmp_path / "head", str(root / "target"), tmp_path / "eagle3", backend="vllm-cpu", k=2)
    prompts = [[1, 2, 3, 4], [5, 9, 7]]
    eos = make_tokenizer().eos_token_id  # vLLM stops on the tokenizer's EOS: ours too
    dec = SpeculativeDecoder(target, target, rule="chain", tree=[1])
    ours = [
        dec.generate_autoregressive(torch.tensor([p]), max_new_tokens=12, temperature=0.0, eos_token_id=eos)
        .sequences[0, len(p) :]
        .tolist()
        for p in prompts
    ]
    spec = {"method": "eagle3", "model": str(out.out_dir), "num_speculative_tokens": 2}
    res = offline_generate(
        str(root / "target"),
        prompts,
        12,
        0.0,
        eos_token_id=eos,
        engine_args={"speculative_config": spec, "enforce_eager": True},
    )
    assert res["responses"] == ours
