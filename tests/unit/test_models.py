"""Model loading, the tokenizer, the tiny Llama factory (no world build needed)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from resispec.models import (
    ModelConfig,
    ModelNotFoundError,
    SizeConfig,
    TokenizerMismatchError,
    check_same_tokenizer,
    load_model,
    load_pair,
    load_tokenizer,
    make_llama,
    resolve_device,
    resolve_model_path,
    train_bpe_tokenizer,
)
from resispec.models.factory import grow_depth

TEXTS = ["def add(a, b):\n    return a + b\n", 'class Foo:\n    """A docstring."""\n    x = 1\n'] * 20
TINY = SizeConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(TEXTS, vocab_size=300)


def _save_checkpoint(path, tokenizer, seed=0):
    torch.manual_seed(seed)
    model = make_llama(TINY, len(tokenizer), 128, tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def test_tokenizer_round_trip_and_specials(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "def f(x):\n\treturn 'é ∑ 😀' + x  # unseen bytes\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id  # bos is prepended, like Llama tokenizers
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert len(tok) <= 300


def test_load_local_checkpoint(tokenizer, tmp_path):
    ref = _save_checkpoint(tmp_path, tokenizer).eval()
    model = load_model(ModelConfig(path=str(tmp_path), dtype="float32", device="cpu"))
    assert not model.training
    x = torch.randint(0, len(tokenizer), (1, 12))  # [1, T]
    torch.testing.assert_close(model(input_ids=x).logits, ref(input_ids=x).logits)
    half = load_model(ModelConfig(path=str(tmp_path), dtype="bfloat16", device="cpu"))
    assert next(half.parameters()).dtype == torch.bfloat16
    tok = load_tokenizer(str(tmp_path))
    assert tok.get_vocab() == tokenizer.get_vocab()


def test_unknown_model_offline_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "resispec-no-such-org/made-up-model-123"
    with pytest.raises(ModelNotFoundError) as info:
        load_model(ModelConfig(path=name, device="cpu"))
    msg = str(info.value)
    assert name in msg and "local path" in msg and "HF_HOME" in msg
    with pytest.raises(ModelNotFoundError):
        load_tokenizer(name)


def test_missing_local_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(ModelConfig(path=str(tmp_path / "nope"), device="cpu"))


def test_mismatched_pair_fails_before_loading(tokenizer, tmp_path):
    other = train_bpe_tokenizer(["SELECT * FROM t WHERE x = 1;\n"] * 30, vocab_size=280)
    _save_checkpoint(tmp_path / "a", tokenizer)
    _save_checkpoint(tmp_path / "b", other)
    with pytest.raises(TokenizerMismatchError, match="target and draft"):
        check_same_tokenizer(tokenizer, other)
    with pytest.raises(TokenizerMismatchError):
        load_pair(
            ModelConfig(path=str(tmp_path / "a"), device="cpu"),
            ModelConfig(path=str(tmp_path / "b"), device="cpu"),
        )
    check_same_tokenizer(tokenizer, load_tokenizer(str(tmp_path / "a")))  # same vocabulary: passes


def test_resolve_device_and_paths():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_model_path("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    with pytest.raises(ModelNotFoundError):
        resolve_model_path("world:nonsense", None)


def test_make_llama_and_grow_depth_preserve_function(tokenizer):
    torch.manual_seed(0)
    model = make_llama(TINY, len(tokenizer), 128, tokenizer).eval()
    assert model.config.num_hidden_layers == 2 and model.config.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():  # non-zero output projections, so a wrong copy would show
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    grown = grow_depth(model, 3).eval()
    assert grown.config.num_hidden_layers == 6
    x = torch.randint(0, len(tokenizer), (2, 10))  # [B, T]
    torch.testing.assert_close(grown(input_ids=x).logits, model(input_ids=x).logits, rtol=1e-5, atol=1e-5)
