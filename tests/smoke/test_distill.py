"""End-to-end distillation on micro models: outputs, plain HF drafts, LoRA export, cached targets, W&B offline
history, clear errors. Resume after a kill and multi-process runs are in test_distill_resume.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resispec.data.config import DataConfig
from resispec.decoding.config import DecodeConfig
from resispec.models.config import ModelConfig, WorldConfig
from resispec.training import DistillJob, EmptyDatasetError, distill
from resispec.training.config import LoggerConfig, LossConfig, OptimConfig, TrainConfig, WandbConfig
from tests.unit.test_training_helpers import VOCAB, make_micro_llama, make_tokenizer, sample_rows, save_pair

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target_dir, draft_dir, (train rows, held-out rows)) of the micro pair."""
    root = tmp_path_factory.mktemp("micro_pair")
    target, draft = save_pair(root)
    return target, draft, (sample_rows(target, 24, seed=0), sample_rows(target, 6, seed=1))


def run_distill(
    pair, out: Path, *, loss=None, train=None, draft=None, wandb="disabled", decode=None, rows=None
):
    target, draft_dir, default_rows = pair
    job = DistillJob(
        world=WorldConfig(),
        target=ModelConfig(path=str(target), device="cpu"),
        draft=draft or ModelConfig(path=str(draft_dir), device="cpu"),
        data=DataConfig(seq_len=32),
        decode=decode or DecodeConfig(tree=[2, 1]),
        loss=loss or LossConfig(),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        train=train
        or TrainConfig(
            num_threads=1, max_steps=6, batch_size=4, eval_every=3, save_every=3, eval_positions=60
        ),
        logger=LoggerConfig(wandb=WandbConfig(mode=wandb), log_every=2),
        output_dir=out,
        name="smoke",
        rows=rows or default_rows,
    )
    return distill(job)


def test_distill_writes_a_plain_hf_draft_that_generate_accepts(pair, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "distill" / "smoke" / "run1"
    result = run_distill(pair, out, wandb="offline")
    assert result.output_dir == out and result.steps == 6 and result.num_processes == 1
    for name in (
        "metrics.json",
        "config.yaml",
        "history.jsonl",
        "draft/model.safetensors",
        "draft/tokenizer.json",
    ):
        assert (out / name).exists(), name
    metrics = json.loads((out / "metrics.json").read_text())
    for phase in ("before", "after"):
        assert set(metrics[phase]["alpha"]["resispec"]) == {"1", "2"}
        assert "rsd" not in metrics[phase]["tau"]  # no closed form: not simulated
    assert len(metrics["losses"]) == 6 and all(map(lambda v: v == v, metrics["losses"]))
    # distillation works: on the held-out positions the draft's fkl to the target falls and the simulated tau of
    # the serving rule rises (the micro draft starts far from its target: both move by far more than noise)
    before, after = metrics["before"], metrics["after"]
    assert after["fkl"] < 0.9 * before["fkl"], (before["fkl"], after["fkl"])
    assert after["tau"]["resispec"] > before["tau"]["resispec"] + 0.02, (before["tau"], after["tau"])
    # the step's throughput: response tokens over the time spent in optimizer steps
    assert metrics["train_step_seconds"] > 0 and metrics["tokens"] > 0
    assert metrics["train_tokens_per_s"] == pytest.approx(
        metrics["tokens"] / metrics["train_step_seconds"], rel=0.01
    )
    # best-by-tau: the saved draft is the checkpoint whose held-out tau is the best of the evaluated ones
    evals = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    taus = {e["step"]: e["eval/tau/resispec"] for e in evals if "eval/tau/resispec" in e}
    assert set(taus) == {3, 6} and metrics["best_step"] == max(taus, key=taus.get)
    assert metrics["after"]["tau"]["resispec"] == pytest.approx(max(taus.values()))
    # the pointer bench uses
    assert (out.parent / "latest").resolve() == out.resolve()

    draft = AutoModelForCausalLM.from_pretrained(out / "draft")
    target = AutoModelForCausalLM.from_pretrained(pair[0])
    tok = AutoTokenizer.from_pretrained(out / "draft")
    assert tok.get_vocab() == make_tokenizer().get_vocab()
    ids = torch.tensor([[2, 3, 4, 5]])
    gen = target.generate(ids, assistant_model=draft, max_new_tokens=6, do_sample=False, pad_token_id=0)
    plain = target.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, plain)  # assisted greedy decoding must reproduce the target's greedy output

    # W&B offline: the run folder holds the history records (keys are stored as plain strings in the log)
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    blob = runs[0].read_bytes()
    for key in (
        b"train/loss",
        b"train/lr",
        b"train/tokens_per_s",
        b"before/tau/resispec",
        b"eval/tau/resispec",
    ):
        assert key in blob, key


def test_lora_with_cached_targets_saves_adapter_and_merged_draft(pair, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    draft_cfg = ModelConfig(path=str(pair[1]), device="cpu", adapter="lora")
    draft_cfg.lora.r, draft_cfg.lora.alpha, draft_cfg.lora.dropout = 4, 8, 0.0
    train = TrainConfig(
        num_threads=1,
        max_steps=4,
        batch_size=4,
        eval_every=4,
        save_every=4,
        eval_positions=40,
        target_signal="cached",
        cached_top_k=8,
        grad_accum=2,
    )
    cache = tmp_path / "cache"
    os.environ["RESISPEC_CACHE"] = str(cache)
    try:
        result = run_distill(
            pair,
            tmp_path / "lora",
            draft=draft_cfg,
            train=train,
            loss=LossConfig(name="residual", form="log_hybrid"),
        )
    finally:
        del os.environ["RESISPEC_CACHE"]
    assert list(cache.glob("*/target_topk/*/dataset_info.json")), (
        "the top-K cache is a saved datasets dataset"
    )
    assert result.adapter_dir is not None and (result.adapter_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(result.draft_dir)
    assert not any("lora" in k for k in merged.state_dict())
    base = AutoModelForCausalLM.from_pretrained(pair[1])
    with_adapter = PeftModel.from_pretrained(base, result.adapter_dir).eval()
    ids = torch.tensor([[2, 7, 9, 11, 3]])
    torch.testing.assert_close(merged(ids).logits, with_adapter(ids).logits, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(merged(ids).logits, AutoModelForCausalLM.from_pretrained(pair[1])(ids).logits)


@pytest.mark.parametrize("loss", ["fkl", "rkl", "jsd", "tvd"])
def test_every_divergence_trains(pair, tmp_path, loss):
    train = TrainConfig(
        num_threads=1, max_steps=3, batch_size=4, eval_every=0, save_every=0, eval_positions=20
    )
    result = run_distill(pair, tmp_path / loss, loss=LossConfig(name=loss), train=train)
    losses = result.metrics["losses"]
    assert len(losses) == 3 and all(v > 0 for v in losses), losses
    # every divergence moves the draft toward the target: the held-out fkl falls
    before, after = result.metrics["before"], result.metrics["after"]
    assert after["fkl"] < before["fkl"], (loss, before["fkl"], after["fkl"])


def test_rule_without_closed_form_is_a_config_error(pair, tmp_path):
    """Raised before any model loads; the entry script prints it as one line like the errors below."""
    from resispec.training import USER_ERRORS, DistillConfigError

    assert DistillConfigError in USER_ERRORS
    with pytest.raises(DistillConfigError, match="closed-form"):
        run_distill(pair, tmp_path / "rsd", loss=LossConfig(rule="rsd"))


def test_zero_steps_still_exports_the_draft(pair, tmp_path):
    train = TrainConfig(num_threads=1, max_steps=0, batch_size=4, eval_positions=20)
    result = run_distill(pair, tmp_path / "zero", train=train)
    assert (result.draft_dir / "model.safetensors").exists()
    assert result.metrics["after"]["tau"] == result.metrics["before"]["tau"]


def test_empty_dataset_is_a_clear_error(pair, tmp_path):
    import datasets

    empty = datasets.Dataset.from_dict({"prompt_ids": [[2, 3]], "response_ids": [[]]})
    with pytest.raises(EmptyDatasetError, match="no response tokens"):
        run_distill(pair, tmp_path / "empty", rows=(empty, empty))


def _script(args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / "train" / "distill.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_entry_script_errors_are_one_line(pair, tmp_path):
    other = tmp_path / "other_vocab"
    model = make_micro_llama(3, 16, 1)
    model.save_pretrained(other)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(
        models.WordLevel({"<pad>": 0, "<eos>": 1, **{f"x{i}": i for i in range(2, VOCAB)}}, "<pad>")
    )
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>").save_pretrained(
        other
    )
    common = [
        f"hydra.run.dir={tmp_path / 'hydra'}",
        "logger.wandb.mode=disabled",
        "target.device=cpu",
        "train.num_threads=1",
    ]
    cases = {
        "missing": [f"target.path={tmp_path / 'missing'}", f"draft.path={pair[1]}"],  # names the model
        "tokenizer": [f"target.path={pair[0]}", f"draft.path={other}"],
    }
    for expect, args in cases.items():
        proc = _script(common + args, {"HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error:") and expect in last.lower(), last


def test_results_are_typed_dataclasses(pair, tmp_path):
    """The pipeline reads these fields."""
    from resispec.training import DistillResult

    names = {f.name for f in dataclasses.fields(DistillResult)}
    assert {"output_dir", "draft_dir", "metrics"} <= names
