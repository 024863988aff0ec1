"""Prompt sets, target regeneration (cache hit / miss), packing with response-only loss masks."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import resispec.data.regen as regen_mod
from resispec.data import DataConfig, DataNotFoundError, RegenConfig, ensure_regenerated, load_prompts, pack
from resispec.models import ModelConfig, load_model, load_tokenizer


@pytest.fixture(scope="module")
def micro(micro_world):
    world, paths = micro_world
    tok = load_tokenizer(ModelConfig(path="world:target"), world)
    return world, tok


def _data(tmp_path, **kw) -> DataConfig:
    regen = RegenConfig(max_new_tokens=8, batch_size=3, temperature=1.0)
    return DataConfig(
        num_train_prompts=5,
        num_eval_prompts=3,
        prompt_tokens=12,
        seq_len=32,
        regen=regen,
        cache_dir=str(tmp_path / "data"),
        **kw,
    )


def test_pack_masks_cover_exactly_the_response():
    import datasets

    rows = datasets.Dataset.from_dict(
        {
            "prompt_ids": [[1, 5, 6], [1] + list(range(10, 30)), [1, 2]],
            "response_ids": [[7, 8, 2], [40, 41, 42], []],
        }
    )
    packed = pack(rows, seq_len=12, pad_id=0)
    assert len(packed) == 2  # the empty response carries no loss: dropped
    first, second = packed[0], packed[1]
    assert first["input_ids"] == [1, 5, 6, 7, 8, 2] + [0] * 6
    assert first["attention_mask"] == [1] * 6 + [0] * 6
    assert first["loss_mask"] == [0, 0, 0, 1, 1, 1] + [0] * 6
    # a long prompt keeps its last seq_len // 2 tokens, then the response
    assert second["input_ids"] == list(range(24, 30)) + [40, 41, 42] + [0] * 3
    for row in packed:
        mask, att = row["loss_mask"], row["attention_mask"]
        assert 0 < sum(mask) < sum(att)  # neither all zeros nor all ones
        assert all(a >= m for a, m in zip(att, mask, strict=True))


def test_stdlib_prompts_deterministic_and_split_disjoint(micro, tmp_path):
    world, tok = micro
    data = _data(tmp_path)
    train = load_prompts(data, tok, "train", world)
    again = load_prompts(data, tok, "train", world)
    held = load_prompts(data, tok, "eval", world)
    assert train["prompt_ids"] == again["prompt_ids"] and len(train) == 5 and len(held) == 3
    assert all(len(p) == 1 + data.prompt_tokens and p[0] == tok.bos_token_id for p in train["prompt_ids"])
    files = lambda ds: {s.split(":")[0] for s in ds["source"]}  # noqa: E731
    assert not files(train) & files(held)
    assert (
        tok.decode(train["prompt_ids"][0], skip_special_tokens=True).lstrip().startswith(("def ", "async "))
    )


def test_jsonl_prompt_and_messages(micro, tmp_path):
    world, tok = micro
    path = tmp_path / "chat.jsonl"
    records = [{"prompt": f"def f{i}(x):"} for i in range(4)] + [
        {"messages": [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "os.path"}]},
        {"conversations": [{"from": "human", "value": "class A:"}, {"from": "gpt", "value": "pass"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records))
    data = _data(tmp_path, source=str(path))
    train, held = load_prompts(data, tok, "train", world), load_prompts(data, tok, "eval", world)
    assert len(train) == 5 and len(held) == 1  # the last rows are held out
    assert tok.decode(train["prompt_ids"][0], skip_special_tokens=True) == "def f0(x):"
    assert "import os" in tok.decode(train["prompt_ids"][4], skip_special_tokens=True)
    assert tok.decode(train["reference_ids"][4], skip_special_tokens=True) == "os.path"
    tok_chat = load_tokenizer(ModelConfig(path="world:target"), world)
    tok_chat.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    )
    chat = load_prompts(data, tok_chat, "eval", world)
    assert tok_chat.decode(chat["prompt_ids"][0], skip_special_tokens=True) == "<user>class A:<assistant>"
    with pytest.raises(DataNotFoundError, match="does not exist"):
        load_prompts(_data(tmp_path, source=str(tmp_path / "missing.jsonl")), tok, "train", world)


def test_regeneration_cache_hit_and_miss(micro, tmp_path, monkeypatch):
    world, tok = micro
    target = load_model(ModelConfig(path="world:target", device="cpu"), world)
    data = _data(tmp_path)
    first = ensure_regenerated(data, target, tok, "train", world, target_id="world:target", progress=False)
    assert first.column_names == ["prompt_ids", "response_ids"] and len(first) == 5
    assert all(0 < len(r) <= data.regen.max_new_tokens for r in first["response_ids"])
    (folder,) = (tmp_path / "data").glob("regen-*[!.]*")
    meta = json.loads((folder / "meta.json").read_text())
    assert (
        meta["target_id"] == "world:target"
        and meta["regen"]["temperature"] == 1.0
        and meta["prompt_set_hash"]
    )

    calls = []
    real = regen_mod._generate_batch
    monkeypatch.setattr(regen_mod, "_generate_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    hit = ensure_regenerated(data, target, tok, "train", world, target_id="world:target", progress=False)
    assert calls == [] and hit["response_ids"] == first["response_ids"]  # nothing changed: cached
    colder = replace(data, regen=replace(data.regen, temperature=0.0))
    miss = ensure_regenerated(colder, target, tok, "train", world, target_id="world:target", progress=False)
    assert calls and len(miss) == 5  # new sampling settings: regenerated
    assert len(list((tmp_path / "data").glob("regen-*"))) == 2


def test_fixed_responses_use_the_source_text(micro, tmp_path):
    world, tok = micro
    fixed = ensure_regenerated(_data(tmp_path, responses="fixed"), None, tok, "eval", world)
    assert len(fixed) == 3 and all(len(r) == 8 for r in fixed["response_ids"])


def test_draft_fraction_mixes_in_the_drafts_own_responses(micro, tmp_path):
    """data.draft_fraction: that share of the training rows carries the draft's greedy continuation; the rest,
    and every held-out row, keep the target's."""
    world, tok = micro
    target = load_model(ModelConfig(path="world:target", device="cpu"), world)
    draft = load_model(ModelConfig(path="world:draft", device="cpu"), world)
    data = _data(tmp_path, draft_fraction=0.4)
    data = replace(data, regen=replace(data.regen, temperature=0.0))  # greedy: comparable to a direct call
    plain = ensure_regenerated(data, target, tok, "train", world, target_id="world:target", progress=False)
    mixed = ensure_regenerated(data, target, tok, "train", world, target_id="world:target", draft=draft)
    assert mixed["prompt_ids"] == plain["prompt_ids"]
    changed = [i for i in range(len(plain)) if mixed["response_ids"][i] != plain["response_ids"][i]]
    own = regen_mod.regenerate(draft, tok, plain.select(changed), data.regen, tmp_path / "d", progress=False)
    assert len(changed) == 2 and [list(r) for r in own["response_ids"]] == [
        mixed["response_ids"][i] for i in changed
    ]
    held_out = ensure_regenerated(data, target, tok, "eval", world, target_id="world:target", draft=draft)
    assert (
        held_out["response_ids"]
        == ensure_regenerated(data, target, tok, "eval", world, target_id="world:target", progress=False)[
            "response_ids"
        ]
    )
