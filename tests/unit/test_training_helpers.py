"""Micro models and synthetic data for the training tests (also imported by tests/smoke/test_distill*.py).

The models are random Llamas with scaled embeddings (varied outputs, see NOTES.md) sharing one small word-level
tokenizer, saved as plain HF folders so the loading path is the real one. Rows are (prompt_ids, response_ids)
sampled from the target itself: target-generated, as regeneration would give.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 64


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def make_micro_llama(seed: int, hidden: int, layers: int, scale: float = 4.0):
    from tests.unit.test_decoding_helpers import micro_llama

    return micro_llama(
        hidden,
        layers,
        VOCAB,
        seed,
        scale,
        num_attention_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=False,
    )


def save_pair(root: Path) -> tuple[Path, Path]:
    """A micro target (2 layers, hidden 32) and draft (1 layer, hidden 16) with one tokenizer."""
    tok = make_tokenizer()
    paths = []
    for name, seed, hidden, layers in (("target", 0, 32, 2), ("draft", 1, 16, 1)):
        path = root / name
        if not (path / "config.json").exists():
            make_micro_llama(seed, hidden, layers).save_pretrained(path)
            tok.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


@torch.no_grad()
def sample_rows(target_path: Path, num_rows: int, prompt_len: int = 6, response_len: int = 20, seed: int = 0):
    """A datasets.Dataset of (prompt_ids, response_ids), responses sampled from the target at temperature 1."""
    import datasets
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_path).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, VOCAB, (num_rows, prompt_len), generator=g)
    ids = prompts
    for _ in range(response_len):
        probs = model(input_ids=ids).logits[:, -1].softmax(-1)  # [R, V]
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return datasets.Dataset.from_dict(
        {"prompt_ids": prompts.tolist(), "response_ids": ids[:, prompt_len:].tolist()}
    )


def test_micro_pair_shares_a_tokenizer(tmp_path):
    t, d = save_pair(tmp_path)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(t).get_vocab() == AutoTokenizer.from_pretrained(d).get_vocab()
    rows = sample_rows(t, 3, response_len=5)
    assert len(rows) == 3 and len(rows[0]["response_ids"]) == 5
