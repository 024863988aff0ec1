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


# ---------------------------------------------------------------------------------------------- killed between two
# checkpoints: the resumed process must do only the steps after the last checkpoint. Training is deterministic, so a
# resume that loads nothing (retrains from step 0) ends on the same weights and losses: the checks below look at the
# WORK the second process did (its log line, the history lines it wrote, its step count), not only at the result.

KILL_AFTER, LAST_CKPT, STEPS = 5, 3, 8  # SIGKILL after optimizer step 5: between the checkpoints at 3 and 6


def _history_steps(path: Path, skip_lines: int) -> list[int]:
    """Steps of the training-loss lines of history.jsonl written after the first `skip_lines` lines."""
    lines = path.read_text().splitlines()[skip_lines:]
    return sorted({row["step"] for row in map(json.loads, lines) if "train/loss" in row})


def resume_problems(
    stdout: str, new_steps: list[int], resumed, full, run_dir: Path, full_dir: Path
) -> list[str]:
    """What is wrong with a resume from step LAST_CKPT (empty: nothing). stdout: the resumed process's output;
    new_steps: the steps it logged (history.jsonl lines it appended)."""
    from safetensors.torch import load_file

    problems = []
    if f"resumed from step {LAST_CKPT} " not in stdout:
        problems.append(f"no 'resumed from step {LAST_CKPT}' line: {stdout[-500:]!r}")
    if new_steps != list(range(LAST_CKPT + 1, STEPS + 1)):
        problems.append(f"the resumed process logged steps {new_steps}, not {LAST_CKPT + 1}..{STEPS}")
    if resumed.steps != STEPS or resumed.metrics["losses"] != pytest.approx(full.metrics["losses"], abs=1e-6):
        problems.append(f"loss curve {resumed.metrics['losses']} against {full.metrics['losses']}")
    # the state after the first step past the resume point (6) and at the end: weights, and the optimizer's moments
    # and step counts (data position: the same micro-batches, else the losses above and these moments differ)
    for step in (6, STEPS):
        got, want = (d / "checkpoints" / f"step_{step:07d}" for d in (run_dir, full_dir))
        for k, v in load_file(want / "model.safetensors").items():
            if not torch.allclose(load_file(got / "model.safetensors")[k], v, rtol=1e-5, atol=1e-6):
                problems.append(f"weights {k} differ at step {step}")
        opt_got = torch.load(got / "optimizer.bin", weights_only=False)["state"]
        opt_want = torch.load(want / "optimizer.bin", weights_only=False)["state"]
        if opt_got.keys() != opt_want.keys():
            problems.append(f"optimizer state keys differ at step {step}")
            continue
        for i, entry in opt_want.items():
            for name, v in entry.items():
                if not torch.allclose(
                    torch.as_tensor(opt_got[i][name]).double(),
                    torch.as_tensor(v).double(),
                    rtol=1e-5,
                    atol=1e-7,
                ):
                    problems.append(f"optimizer {name} of parameter {i} differs at step {step}")
    return problems


@pytest.fixture(scope="module")
def killed_between_checkpoints(tmp_path_factory):
    """The uninterrupted run and a run SIGKILLed after step KILL_AFTER (a real kill, in a subprocess), shared by the
    tests below (each resumes a copy). -> (pair_dir, full result, full dir, killed dir)."""
    root = tmp_path_factory.mktemp("resume_between")
    pair_dir = root / "pair"
    full = run(pair_dir, root / "full")
    killed = root / "runs" / "killed"
    proc = _launch([sys.executable], pair_dir, killed, {"RESISPEC_CRASH_AT": f"step:{KILL_AFTER}"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert ckpt_steps(killed) == [LAST_CKPT]  # nothing was saved after the last checkpoint before the kill
    logged = _history_steps(killed / "history.jsonl", 0)
    # the kill comes after step 5's optimizer step, before its log line: the killed run logged step 4, past the
    # checkpoint (so a restart from scratch, or from the wrong checkpoint, would be seen redoing steps)
    assert logged[-1] == KILL_AFTER - 1, logged
    return pair_dir, full, root / "full", killed


def ckpt_steps(run_dir: Path) -> list[int]:
    from resispec.training.checkpoint import checkpoint_steps

    return checkpoint_steps(run_dir / "checkpoints")


def _resume_copy(killed: Path, dest: Path, pair_dir: Path, capfd):
    """Resume a copy of the killed run in this process -> (result, its stdout, steps it logged)."""
    shutil.copytree(killed, dest)
    before = len((dest / "history.jsonl").read_text().splitlines())
    capfd.readouterr()
    resumed = run(pair_dir, dest, resume=True)
    out = capfd.readouterr().out
    return resumed, out, _history_steps(dest / "history.jsonl", before)


def test_killed_between_checkpoints_resumes_from_the_last_one(killed_between_checkpoints, tmp_path, capfd):
    """SIGKILL after step 5 (checkpoints at 3 and 6): the resumed process says 'resumed from step 3', logs steps
    4..8 only, and its weights and optimizer state at steps 6 and 8 are the uninterrupted run's."""
    pair_dir, full, full_dir, killed = killed_between_checkpoints
    out_dir = tmp_path / "runs" / "killed"
    resumed, stdout, new_steps = _resume_copy(killed, out_dir, pair_dir, capfd)
    assert resume_problems(stdout, new_steps, resumed, full, out_dir, full_dir) == []


def test_a_resume_that_loads_nothing_is_caught(killed_between_checkpoints, tmp_path, capfd, monkeypatch):
    """The plant of issue 42: accelerate's load_state replaced by a no-op. Training is deterministic, so the run
    retrains from step 0 and ends on the same losses and weights; resume_problems must still see it."""
    import accelerate

    pair_dir, full, full_dir, killed = killed_between_checkpoints
    monkeypatch.setattr(accelerate.Accelerator, "load_state", lambda self, *args, **kwargs: None)
    out_dir = tmp_path / "runs" / "killed"
    resumed, stdout, new_steps = _resume_copy(killed, out_dir, pair_dir, capfd)
    problems = resume_problems(stdout, new_steps, resumed, full, out_dir, full_dir)
    assert any("resumed from step" in p for p in problems), problems
    assert any("logged steps" in p for p in problems), problems
    # and what a result-only test saw: the same loss curve (why the old test could not fail)
    assert resumed.metrics["losses"] == pytest.approx(full.metrics["losses"], abs=1e-6)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_with_torchrun(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    pair_dir = tmp_path / "pair"
    save_pair(pair_dir)
    out = tmp_path / "runs" / "ddp"
    proc = _launch(
        [torchrun, "--nproc_per_node", "2", "--master_port", str(_free_port())],
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
