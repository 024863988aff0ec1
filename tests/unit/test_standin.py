"""The stand-in of a real recipe (resispec/models/standin.py): its shapes against the shipped config.json, its
tokenizer's special ids and chat templates against the real formats, its dataset's splits and columns, and the
one-line refusals. Fast: no model weights, and the BPE is trained on a few stdlib modules."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from resispec.config import ResiSpecConfig
from resispec.data.config import DataConfig
from resispec.errors import UserError
from resispec.models.config import ModelConfig
from resispec.models.hub_configs import shipped_config_dir, shipped_hub_names
from resispec.models.standin import (
    DRAFT_SIZE,
    FAMILIES,
    SPLITS,
    TARGET_SIZE,
    StandinError,
    _dataset_rows,
    build_tokenizer,
    family_of,
    shrunk_config,
    standin_spec,
)

LLAMA_8B, LLAMA_1B = "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"
QWEN_8B, QWEN_06B = "Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"
ULTRACHAT = "HuggingFaceH4/ultrachat_200k"


def _real(name: str) -> dict:
    return json.loads((shipped_config_dir(name) / "config.json").read_text())


def _generation(name: str) -> dict:
    return json.loads((shipped_config_dir(name) / "generation_config.json").read_text())


def test_the_recipes_hub_models_ship_their_config():
    assert {LLAMA_8B, LLAMA_1B, QWEN_8B, QWEN_06B} <= set(shipped_hub_names())
    assert shipped_config_dir("org/not-shipped") is None and shipped_config_dir("../etc") is None
    # the real values the code path depends on
    assert _real(QWEN_8B)["vocab_size"] == _real(QWEN_06B)["vocab_size"] == 151936
    assert _real(QWEN_8B)["tie_word_embeddings"] is False and _real(QWEN_06B)["tie_word_embeddings"] is True
    assert _real(QWEN_8B)["head_dim"] == _real(QWEN_06B)["head_dim"] == 128
    assert (_real(QWEN_8B)["bos_token_id"], _real(QWEN_8B)["eos_token_id"]) == (151643, 151645)
    assert _real(LLAMA_8B)["eos_token_id"] == [128001, 128008, 128009]
    assert _generation(QWEN_8B)["eos_token_id"] == [151645, 151643]


@pytest.mark.parametrize(
    "name,size",
    [(LLAMA_8B, TARGET_SIZE), (LLAMA_1B, DRAFT_SIZE), (QWEN_8B, TARGET_SIZE), (QWEN_06B, DRAFT_SIZE)],
)
def test_shrunk_config_keeps_what_the_code_path_depends_on(name, size):
    real = _real(name)
    config = shrunk_config(real, size)
    assert config.architectures == real["architectures"] and config.model_type == real["model_type"]
    for key in (
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "head_dim",
        "rope_theta",
    ):
        got = getattr(config, key, None)
        if key == "rope_theta" and got is None:  # transformers 5 keeps it in rope_parameters
            got = config.rope_parameters["rope_theta"]
        assert got == real[key], key
    assert config.max_position_embeddings == real["max_position_embeddings"]
    ratio = real["num_attention_heads"] // real["num_key_value_heads"]
    assert config.num_attention_heads // config.num_key_value_heads == ratio  # the GQA ratio
    if real.get("rope_scaling"):  # Llama 3's llama3 rope scaling, factor and frequencies
        params = getattr(config, "rope_parameters", None) or config.rope_scaling
        for key, value in real["rope_scaling"].items():
            assert params[key] == value, key
    # small where the code path does not care
    assert config.hidden_size == size.hidden_size and config.num_hidden_layers == size.num_layers
    assert config.hidden_size < real["hidden_size"] and config.num_hidden_layers < real["num_hidden_layers"]


@pytest.fixture(scope="module")
def texts():
    from resispec.models.world import stdlib_files

    return [p.read_text(encoding="utf-8", errors="replace") for _, p in stdlib_files(12)]


@pytest.fixture(scope="module")
def llama_tok(texts):
    return build_tokenizer(FAMILIES["llama3"], texts)


@pytest.fixture(scope="module")
def qwen_tok(texts):
    return build_tokenizer(FAMILIES["qwen3"], texts)


def test_llama3_tokenizer_has_the_real_special_ids(llama_tok):
    tok = llama_tok
    assert len(tok) == 128256 == _real(LLAMA_8B)["vocab_size"]
    ids = {
        "<|begin_of_text|>": 128000,
        "<|end_of_text|>": 128001,
        "<|reserved_special_token_0|>": 128002,
        "<|finetune_right_pad_id|>": 128004,
        "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007,
        "<|eom_id|>": 128008,
        "<|eot_id|>": 128009,
        "<|python_tag|>": 128010,
        "<|reserved_special_token_247|>": 128255,
    }
    for token, i in ids.items():
        assert tok.convert_tokens_to_ids(token) == i, token
    assert (tok.bos_token_id, tok.eos_token_id) == (128000, 128009)
    enc = tok("def f(x): return x")["input_ids"]
    assert enc[0] == 128000 and max(enc[1:]) < 128000  # BOS on encode; text maps to ordinary ids only
    assert tok.decode(enc, skip_special_tokens=True) == "def f(x): return x"


def test_qwen3_tokenizer_has_the_real_special_ids(qwen_tok):
    tok = qwen_tok
    assert len(tok) == 151669 < _real(QWEN_8B)["vocab_size"]  # as the real one: the model's vocab is padded
    for token, i in {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}.items():
        assert tok.convert_tokens_to_ids(token) == i, token
    for token, i in {"<tool_call>": 151657, "<think>": 151667, "</think>": 151668}.items():
        assert tok.convert_tokens_to_ids(token) == i, token
    assert tok.bos_token is None and tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    assert tok("hello")["input_ids"][0] != 151643  # Qwen adds no BOS
    # <think> is added but not special: it survives skip_special_tokens, as in the real tokenizer
    ids = tok.encode("<think>\nhm\n</think>\n\nok<|im_end|>", add_special_tokens=False)
    assert ids[0] == 151667 and ids[-1] == 151645
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nhm\n</think>\n\nok"


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


def test_llama3_chat_template_renders_the_header_format(llama_tok):
    text = llama_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    no_system = llama_tok.apply_chat_template(CHAT[1:2], add_generation_prompt=False, tokenize=False)
    assert no_system.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting")
    assert no_system.endswith(
        "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    )
    ids = llama_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[:2] == [128000, 128006] and ids.count(128000) == 1 and ids.count(128009) == 4  # one BOS


def test_qwen3_chat_template_renders_im_start_and_the_thinking_switch(qwen_tok):
    head = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    thinking = qwen_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert thinking == head  # thinking on (the default): the model opens <think> itself
    on = qwen_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert on == head
    off = qwen_tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert off == head + "<think>\n\n</think>\n\n"
    # an answered last turn keeps its (here empty) think block; earlier turns' thinking is dropped
    done = CHAT + [{"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}]
    text = qwen_tok.apply_chat_template(done, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n")
    again = done + [{"role": "user", "content": "And 3+3?"}]
    assert "add" not in qwen_tok.apply_chat_template(again, tokenize=False, add_generation_prompt=True)


def test_the_dataset_has_ultrachat_splits_and_columns():
    rows = _dataset_rows()
    assert tuple(rows) == SPLITS == ("train_sft", "test_sft", "train_gen", "test_gen")
    seen = set()
    for split, split_rows in rows.items():
        assert len(split_rows) >= 64, split
        for row in split_rows:
            assert set(row) == {"prompt", "prompt_id", "messages"}
            assert row["messages"][0] == {"role": "user", "content": row["prompt"]}
            assert [m["role"] for m in row["messages"]][:2] == ["user", "assistant"]
            assert len(row["prompt_id"]) == 64
        ids = {r["prompt_id"] for r in split_rows}
        assert not ids & seen, split  # splits are disjoint
        seen |= ids
    assert any(len(r["messages"]) == 4 for r in rows["train_sft"])  # multi-turn conversations too
    assert rows == _dataset_rows()  # deterministic


def _cfg(target=LLAMA_8B, draft=LLAMA_1B, **data) -> ResiSpecConfig:
    data = {
        "source": ULTRACHAT,
        "split": "train_sft",
        "eval_split": "test_sft",
        "test_split": "test_sft",
        **data,
    }
    return replace(
        ResiSpecConfig(standin=True),
        target=ModelConfig(path=target),
        draft=ModelConfig(path=draft),
        data=DataConfig(**data),
    )


def test_standin_spec_accepts_the_real_recipes():
    assert standin_spec(_cfg()).target == LLAMA_8B
    spec = standin_spec(_cfg(QWEN_8B, QWEN_06B))
    assert spec.family().name == "qwen3" and spec.hash() == standin_spec(_cfg(QWEN_8B, QWEN_06B)).hash()
    assert standin_spec(_cfg()).hash() != spec.hash()


@pytest.mark.parametrize(
    "cfg,says",
    [
        (_cfg(target="world:target"), "target.path='world:target' has no shipped config.json"),
        (_cfg(draft="someone/unknown-1B"), "draft.path='someone/unknown-1B' has no shipped config.json"),
        (_cfg(split="train"), "data.split='train' is not a split of HuggingFaceH4/ultrachat_200k"),
        (_cfg(test_split="test"), "data.test_split='test' is not a split"),
        (_cfg(source="stdlib"), "data.source='stdlib' has no stand-in"),
        (_cfg(QWEN_8B, LLAMA_1B), "do not share a tokenizer family"),
    ],
)
def test_standin_refuses_what_it_cannot_stand_in_for(cfg, says):
    with pytest.raises(StandinError, match=None) as err:
        standin_spec(cfg)
    assert isinstance(err.value, UserError) and says in str(err.value) and "\n" not in str(err.value)


def test_family_of_refuses_an_unknown_architecture():
    with pytest.raises(StandinError, match="no stand-in tokenizer for model_type 'mistral'"):
        family_of({"model_type": "mistral", "vocab_size": 32768})
