"""The embedded tiny world: deterministic disjoint splits, the config-hash cache, the micro world built in the run."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from resispec.models import (
    ModelConfig,
    WorldConfig,
    cache_root,
    config_hash,
    ensure_world,
    load_pair,
    resolve_model_path,
    stdlib_splits,
)
from resispec.models.world import SPLITS, split_of, stdlib_split_files


def test_splits_are_deterministic_disjoint_and_by_module():
    world = WorldConfig()
    a, b = stdlib_split_files(world), stdlib_split_files(world)
    assert {s: [k for k, _ in v] for s, v in a.items()} == {s: [k for k, _ in v] for s, v in b.items()}
    keys = {s: {k for k, _ in v} for s, v in a.items()}
    assert all(keys[s] for s in SPLITS)
    assert not (
        keys["train"] & keys["validation"]
        or keys["train"] & keys["test"]
        or keys["validation"] & keys["test"]
    )
    assert all(split_of(k) == s for s in SPLITS for k in keys[s])
    assert not any("/test/" in f"/{k}" or k.startswith("site-packages") for s in SPLITS for k in keys[s])
    # roughly 90/5/5 by module count (the split is a hash, so only loosely)
    total = sum(len(v) for v in keys.values())
    assert len(keys["train"]) > 0.8 * total


def test_stdlib_splits_texts_and_max_files():
    texts = stdlib_splits(WorldConfig(max_files=40))
    assert sum(len(v) for v in texts.values()) == 40
    assert (
        all(isinstance(t, str) for v in texts.values() for t in v) and sum(map(len, texts["train"])) > 10_000
    )


def test_config_hash_and_cache_root(monkeypatch, tmp_path):
    world = WorldConfig()
    assert config_hash(world) == config_hash(replace(world, cache_dir="/elsewhere", num_threads=1))
    assert config_hash(world) != config_hash(replace(world, vocab_size=4096))
    monkeypatch.setenv("RESISPEC_CACHE", str(tmp_path / "env"))
    assert cache_root(world) == tmp_path / "env"
    assert cache_root(replace(world, cache_dir=str(tmp_path / "cfg"))) == tmp_path / "cfg"
    monkeypatch.delenv("RESISPEC_CACHE")
    assert str(cache_root(world)).endswith(".cache/resispec")


def test_micro_world_is_a_real_lm(micro_world):
    world, paths = micro_world
    assert paths.root.name == f"{world.name}-{config_hash(world)}"
    report = json.loads((paths.root / "report.json").read_text())
    assert report == paths.report
    # a real LM: the target beats the unigram baseline and the briefly trained draft on held-out modules
    assert report["target_loss"] < report["unigram_loss"] - 0.3
    assert report["target_loss"] < report["draft_loss"]
    assert report["target"]["params"] > 2 * report["draft"]["params"]
    assert report["target_ms"] > 0 and report["draft_ms"] > 0
    assert len(report["samples"]) == 3
    tok = AutoTokenizer.from_pretrained(paths.tokenizer_dir)
    assert tok.bos_token and tok.eos_token and tok.pad_token and len(tok) == world.vocab_size


def test_micro_world_cache_hit_and_loading(micro_world, monkeypatch):
    import resispec.models.world as world_module

    world, paths = micro_world

    def no_build(*args, **kwargs):
        raise AssertionError("a cached world was rebuilt")

    # cached: bounded by work (nothing rebuilt), not by the clock
    with monkeypatch.context() as m:
        m.setattr(world_module, "_build", no_build)
        again = ensure_world(world, progress=False)
    assert again.root == paths.root and again.report == paths.report
    assert resolve_model_path("world:target", world) == str(paths.target_dir)
    target, draft, tok = load_pair(
        ModelConfig(path="world:target", device="cpu"), ModelConfig(path="world:draft", device="cpu"), world
    )
    ids = tok("def main():", return_tensors="pt")["input_ids"]  # [1, T]
    with torch.no_grad():
        assert (
            target(input_ids=ids).logits.shape
            == draft(input_ids=ids).logits.shape
            == (1, ids.shape[1], len(tok))
        )


@pytest.mark.parametrize("bad", ["world:nonsense"])
def test_unknown_world_name(bad, micro_world):
    from resispec.models import ModelNotFoundError

    with pytest.raises(ModelNotFoundError):
        resolve_model_path(bad, micro_world[0])


def test_pretraining_precision_modes():
    """auto -> bf16 exactly where oneDNN (CPU) or the GPU multiplies bf16 natively; the step trains either way."""
    from resispec.models.config import PretrainConfig, SizeConfig
    from resispec.models.factory import make_llama
    from resispec.models.pretraining import resolve_mixed_precision, train_lm

    assert resolve_mixed_precision("no") == "no" and resolve_mixed_precision("bf16") == "bf16"
    assert resolve_mixed_precision("auto") == (
        "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no"
    )
    with pytest.raises(ValueError, match="auto, bf16 or no"):
        resolve_mixed_precision("fp8")
    stream = torch.randint(0, 64, (4096,), generator=torch.Generator().manual_seed(0)).numpy()
    size = SizeConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    for mode in ("no", "bf16"):
        torch.manual_seed(0)
        model = make_llama(size, 64, 128)
        cfg = PretrainConfig(max_steps=3, batch_size=2, seq_len=32, warmup_steps=1, mixed_precision=mode)
        stats = train_lm(model, stream, cfg, seed=0, progress=False)
        assert stats["mixed_precision"] == mode and stats["steps"] == 3
        assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: weights stay float32


def test_build_estimate_times_real_steps_and_changes_nothing(micro_world, tmp_path, capsys):
    """A build with progress announces its time from timed steps of throwaway models, and builds the very same
    world as a silent build (the probe runs before the seeded models)."""
    from safetensors.torch import load_file

    world, paths = micro_world
    again = ensure_world(replace(world, cache_dir=str(tmp_path)), progress=True)
    out = capsys.readouterr().out.splitlines()
    line = next(x for x in out if "estimated build time" in x)
    minutes = float(line.split("~")[1].split(" ")[0])
    assert 0.5 < minutes < 30 and "timed probe steps: draft" in line
    assert any("target: ~" in x and "min left" in x for x in out)  # corrected by the draft's real pace
    for role in ("target_dir", "draft_dir"):
        a = load_file(getattr(paths, role) / "model.safetensors")
        b = load_file(getattr(again, role) / "model.safetensors")
        assert a.keys() == b.keys(), role
        model = role.removesuffix("_dir")
        runs = [
            {k: p.report.get(model, {}).get(k) for k in ("steps", "stopped_by", "train_seconds")}
            for p in (paths, again)
        ]
        # the same training: the same steps and stop; the weights equal up to float drift (a CPU matmul's reduction
        # order can change with the threads it gets on a loaded machine: ~4e-6 seen), never by a changed update
        assert all(
            r["steps"] == runs[0]["steps"] and r["stopped_by"] == runs[0]["stopped_by"] for r in runs
        ), runs
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        assert diff < 1e-4, (
            f"{role}: the two builds differ (max abs {diff:.3g}); silent {runs[0]}, this {runs[1]}"
        )
