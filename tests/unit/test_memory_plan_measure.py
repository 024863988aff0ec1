"""The memory plan as a JSON object from the shipped config.json files (offline), every shipped recipe and launch
within 80 GB, the refusal on a GPU too small for the plan, and `--measure` on the llama3 stand-in: the plan
predicts the measured peak of one real step within 20%."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from resispec.training import memory_plan as mp

ROOT = Path(__file__).resolve().parents[2]
LAUNCHES = [None, *sorted(str(p) for p in (ROOT / "recipes" / "accelerate").glob("*.yaml"))]


def _plan_json(*args: str) -> dict:
    sys.path.insert(0, str(ROOT / "train"))
    try:
        import memory_plan as cli  # train/memory_plan.py
    finally:
        sys.path.pop(0)
    return json.loads(cli.main([*args, "--json"]).strip().splitlines()[-1])


@pytest.mark.parametrize("recipe", ["llama3", "llama3_lora", "qwen3"])
def test_every_shipped_recipe_and_launch_fits_80_gb_by_the_plan(recipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the shipped config.json files, never the hub
    for launch in LAUNCHES:
        out = _plan_json(f"+recipe={recipe}", *(["--accelerate_config", launch] if launch else []))
        assert 0 < out["per_device_gib"] < 80 / 1.073741824, (launch, out)  # 80 GB = 74.5 GiB
        assert out["rows"]["loss"] < out["per_device_gib"] / 2


def _shape(vocab=128256, hidden=2048):
    return mp.ModelShape(10**9, hidden, 16, 4 * hidden, 512, vocab)


def test_the_loss_row_grows_with_the_chunk_not_with_the_positions():
    one = dict(
        target_dtype="bfloat16", draft_dtype="bfloat16", lora=False, target_signal="online", cached_top_k=64
    )
    plan = lambda b, chunk: mp.plan_memory(  # noqa: E731
        _shape(),
        _shape(),
        mp.Sharding("one"),
        batch_size=b,
        seq_len=2048,
        response_len=512,
        chunk_size=chunk,
        **one,
    )
    small, big = plan(1, 256).row("loss"), plan(8, 256).row("loss")
    assert big < 2 * small  # 8x the positions: only the [N, h] rows grow
    assert plan(8, 1024).row("loss") > big


def test_a_plan_over_the_gpu_memory_is_refused_unless_forced(monkeypatch):
    plan = mp.MemoryPlan(mp.Sharding("single device"), [("draft weights", 100 * mp.GIB, "")])
    props = types.SimpleNamespace(total_memory=80 * 10**9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    with pytest.raises(mp.MemoryPlanError, match=r"needs 100\.0 GiB .* train\.force_memory=true"):
        mp.check_fits(plan, torch.device("cuda", 0))
    mp.check_fits(plan, torch.device("cuda", 0), force=True)
    mp.check_fits(plan, torch.device("cpu"))  # nothing to compare with on the CPU
    plan.rows = [("draft weights", 10 * mp.GIB, "")]
    mp.check_fits(plan, torch.device("cuda", 0))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["llama3", "qwen3"])
def test_measure_on_the_standin_is_within_20_percent_of_the_plan(recipe, tmp_path):
    """One real step of the stand-in (V = 128,256 / 151,936) at batch 2 x 256 tokens: ~20-60 s with its build."""
    cmd = [sys.executable, str(ROOT / "train" / "memory_plan.py"), f"+recipe={recipe}", "standin=true"]
    cmd += [f"world.cache_dir={tmp_path}", "train.batch_size=2", "data.seq_len=256", "--measure", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["standin"] is True and out["response_positions"] == 2 * min(255, 512)
    assert abs(out["predicted_gib"] - out["measured_gib"]) <= 0.2 * out["measured_gib"], out
