"""FSDP on 2 CPU processes (gloo), launched as users launch it: `accelerate launch --config_file
recipes/accelerate/fsdp_cpu.yaml ...`. Checks that both ranks ran sharded, that the losses equal a single-process
run over the same global batch, that only rank 0 writes the outputs, that the exported draft is the same plain HF
checkpoint, that a sharded checkpoint consolidates into one, and that a run SIGKILLed after a checkpoint resumes
onto the uninterrupted loss curve. Measured on the loaded 2-core machine: the first test ~55 s (one
single-process run and one 2-process launch; default run), the kill/resume test ~55 s more (two launches; `slow`).
The launch refusals and config parsing are fast unit tests: tests/unit/test_training_launch.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.smoke.processes import free_port as _free_port
from tests.smoke.test_distill_resume import _launch, _result, run

ROOT = Path(__file__).resolve().parents[2]
FSDP_CPU = ROOT / "recipes" / "accelerate" / "fsdp_cpu.yaml"
STEPS = dict(max_steps=4, save_every=2)  # checkpoints at steps 2 and 4; held-out evaluation at step 4

# 2 processes x batch 2 (FSDP) and 1 process x batch 2 x grad_accum 2 see the same 4 rows per step, split the
# same way (batch_indices), and average the same two gradients: equal up to float reduction order.
LOSS_RTOL = 1e-4


def _accelerate(port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(FSDP_CPU),
        "--main_process_port",
        str(port),
    ]


def _ranks(out: Path) -> list[dict]:
    """What each process returned (the runner writes <out>.rank<RANK>.json)."""
    return [json.loads(p.read_text()) for p in sorted(out.parent.glob(out.name + ".rank*.json"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(pair dir, single-process run dir + its losses, FSDP run dir, the FSDP launch)."""
    root = tmp_path_factory.mktemp("fsdp")
    pair_dir = root / "pair"
    single = run(pair_dir, root / "single", grad_accum=2, **STEPS)
    proc = _launch(_accelerate(_free_port()), pair_dir, root / "runs" / "fsdp", {}, **STEPS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return pair_dir, single, root / "runs" / "fsdp", proc


def test_fsdp_shards_matches_one_process_and_exports_a_plain_draft(runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _, single, out, proc = runs
    ranks = _ranks(out)
    assert len(ranks) == 2 and sorted(r["is_main"] for r in ranks) == [False, True]  # both ranks ran
    for r in ranks:
        assert r["num_processes"] == 2 and r["distributed_type"] == "FSDP", r
        local, total = r["param_numel"]
        assert 0 < local < total, r  # each rank holds a part of the parameters ...
    assert (
        sum(r["param_numel"][0] for r in ranks) == ranks[0]["param_numel"][1]
    )  # ... and together all of them
    assert "[distributed] FSDP over gloo on 2 CPU processes" in proc.stdout + proc.stderr

    result = _result(proc)
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(single.metrics["losses"]), rtol=LOSS_RTOL, atol=1e-6
    )

    # only rank 0 writes: one history record per step, the same files as the single-process run
    records = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4]
    top = lambda d: sorted(p.name for p in d.iterdir())  # noqa: E731
    assert top(out) == top(single.output_dir)
    assert top(out / "draft") == top(single.draft_dir)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["distributed_type"] == "FSDP" and metrics["num_processes"] == 2

    # checkpoints in the format fsdp_cpu.yaml names (SHARDED_STATE_DICT): one shard file per rank, no full copy
    ckpt = out / "checkpoints" / "step_0000004"
    assert sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert not (ckpt / "model.safetensors").exists()

    # the exported draft: a plain HF checkpoint with the single-process run's keys (and, here, its values)
    draft, reference = (
        load_file(out / "draft" / "model.safetensors"),
        load_file(single.draft_dir / "model.safetensors"),
    )
    assert sorted(draft) == sorted(reference)
    for k in reference:
        torch.testing.assert_close(draft[k], reference[k], rtol=1e-3, atol=1e-5)
    AutoModelForCausalLM.from_pretrained(out / "draft")

    # the documented consolidation (`accelerate merge-weights`): the step-4 checkpoint is the exported draft
    from accelerate.utils import merge_fsdp_weights

    merge_fsdp_weights(
        str(ckpt / "pytorch_model_fsdp_0"), str(out.parent / "merged"), safe_serialization=True
    )
    merged = load_file(out.parent / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(draft)
    for k in draft:
        torch.testing.assert_close(merged[k], draft[k])


@pytest.mark.slow  # two more 2-process launches: ~55 s on the 2-core machine
def test_fsdp_killed_after_a_checkpoint_resumes_onto_the_same_losses(runs, tmp_path):
    pair_dir, _, full_out, full_proc = runs
    out = tmp_path / "runs" / "killed"
    proc = _launch(_accelerate(_free_port()), pair_dir, out, {"RESISPEC_CRASH_AT": "save:4"}, **STEPS)
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]  # every rank killed itself
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp-step_0000004", "step_0000002"]

    proc = _launch(_accelerate(_free_port()), pair_dir, out, {}, resume=True, **STEPS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from step 2" in proc.stdout + proc.stderr
    resumed, full = _result(proc), _result(full_proc)
    assert resumed["steps"] == 4 and resumed["distributed_type"] == "FSDP"
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(full["losses"]), rtol=1e-5, atol=1e-6
    )
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_0000002", "step_0000004"]
