"""Kill a run mid-way (SIGKILL while it writes a checkpoint), resume it, and get the uninterrupted loss curve;
and a real 2-process run (torchrun + gloo on CPU)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.test_training_helpers import sample_rows, save_pair

ROOT = Path(__file__).resolve().parents[2]

# Runs distill on the micro pair in a fresh interpreter (argv: pair dir, output dir, json overrides).
RUNNER = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from tests.smoke.test_distill_resume import run
result = run(Path(sys.argv[1]), Path(sys.argv[2]), **json.loads(sys.argv[3]))
info = {"steps": result.steps, "num_processes": result.num_processes, "losses": result.metrics["losses"],
        "distributed_type": result.distributed_type, "param_numel": result.param_numel, "is_main": result.is_main}
Path(sys.argv[2] + ".rank" + os.environ.get("RANK", "0") + ".json").write_text(json.dumps(info))  # per process
if result.is_main:
    print("RESULT " + json.dumps(info), flush=True)
"""


def run(
    pair_dir: Path,
    out: Path,
    max_steps: int = 8,
    resume: bool = False,
    save_every: int = 3,
    batch_size: int = 2,
    grad_accum: int = 1,
):
    """The run every test in this file repeats: identical data, models and settings."""
    from resispec.data.config import DataConfig
    from resispec.decoding.config import DecodeConfig
    from resispec.models.config import ModelConfig, WorldConfig
    from resispec.training import DistillJob, distill
    from resispec.training.config import LoggerConfig, LossConfig, OptimConfig, TrainConfig, WandbConfig

    target, draft = save_pair(pair_dir)
    rows = (sample_rows(target, 16, seed=0), sample_rows(target, 4, seed=1))
    job = DistillJob(
        world=WorldConfig(),
        target=ModelConfig(path=str(target), device="cpu"),
        draft=ModelConfig(path=str(draft), device="cpu"),
        data=DataConfig(seq_len=32),
        decode=DecodeConfig(tree=[2, 1]),
        loss=LossConfig(),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        train=TrainConfig(
            num_threads=1,
            max_steps=max_steps,
            batch_size=batch_size,
            grad_accum=grad_accum,
            eval_every=4,
            save_every=save_every,
            keep_checkpoints=3,
            eval_positions=30,
            resume=resume,
        ),
        logger=LoggerConfig(wandb=WandbConfig(mode="disabled"), log_every=1),
        output_dir=out,
        name="resume",
        rows=rows,
    )
    return distill(job)


def _launch(
    cmd_prefix: list[str], pair_dir: Path, out: Path, env_extra: dict, **kw
) -> subprocess.CompletedProcess:
    script = out.parent / "runner.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(RUNNER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    cmd = [*cmd_prefix, str(script), str(pair_dir), str(out), json.dumps(kw), str(ROOT)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


def test_kill_while_saving_then_resume_gives_the_same_loss_curve(tmp_path):
    from safetensors.torch import load_file

    pair_dir = tmp_path / "pair"
    full = run(pair_dir, tmp_path / "full")  # the uninterrupted reference, 8 steps
    assert full.steps == 8

    out = tmp_path / "runs" / "killed"
    proc = _launch([sys.executable], pair_dir, out, {"RESISPEC_CRASH_AT": "save:6"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp-step_0000006", "step_0000003"]  # 6 never renamed
    good = load_file(ckpts / "step_0000003" / "model.safetensors")

    resumed = run(pair_dir, out, resume=True)
    assert resumed.output_dir == out and resumed.steps == 8
    torch.testing.assert_close(
        torch.tensor(resumed.metrics["losses"]), torch.tensor(full.metrics["losses"]), rtol=1e-5, atol=1e-6
    )
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["step_0000003", "step_0000006", "step_0000008"]  # the crash's temporary folder is gone
    for name in names:  # every checkpoint complete and readable; the old one untouched
        assert (ckpts / name / "COMPLETE").read_text() == str(int(name.split("_")[1]))
        load_file(ckpts / name / "model.safetensors")
    torch.testing.assert_close(load_file(ckpts / "step_0000003" / "model.safetensors"), good)
    final = load_file(ckpts / "step_0000008" / "model.safetensors")
    reference = load_file(tmp_path / "full" / "checkpoints" / "step_0000008" / "model.safetensors")
    for k in reference:
        torch.testing.assert_close(final[k], reference[k], rtol=1e-5, atol=1e-6)


def test_two_processes_with_torchrun(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    pair_dir = tmp_path / "pair"
    save_pair(pair_dir)
    out = tmp_path / "runs" / "ddp"
    proc = _launch(
        [torchrun, "--nproc_per_node", "2", "--master_port", "29517"],
        pair_dir,
        out,
        {},
        max_steps=2,
        save_every=2,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _result(proc)
    assert result["num_processes"] == 2 and result["steps"] == 2  # a silent single-process run fails here
    # only the main process wrote: one line per step in the history, one set of outputs
    steps = [json.loads(line)["step"] for line in (out / "history.jsonl").read_text().splitlines()]
    assert steps.count(1) == 1 and steps.count(2) >= 1
    ckpt = out / "checkpoints" / "step_0000002"
    assert (ckpt / "random_states_0.pkl").exists() and (ckpt / "random_states_1.pkl").exists()
    assert (out / "draft" / "model.safetensors").exists()
