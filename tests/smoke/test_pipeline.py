"""The main job (`bash scripts/main.sh` = train/pipeline.py) end to end on the micro world, and its stage clock."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pipeline_module():
    spec = importlib.util.spec_from_file_location("resispec_pipeline_script", ROOT / "train" / "pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pipeline_runs_every_stage_on_the_micro_world(micro_world, tmp_path):
    world, paths = micro_world
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "train" / "pipeline.py"),
        "+recipe=debug",
        f"world.cache_dir={world.cache_dir}",
        f"hydra.run.dir={run_dir}",
        "bench.hf_assisted=false",
        "bench.plan_rules=[]",
        "bench.rules=[chain,rrs]",
        "bench.trees=[[2,1]]",
        "logger.wandb.mode=disabled",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # every stage announces itself with the job's time so far; the world was cached by the fixture
    for i, title in enumerate(("world micro: cached", "regenerate", "bench"), start=1):
        assert f"== [{i}/4] " in out and title in out, out[-3000:]
    assert "stage times: world" in out
    assert (run_dir / "bench" / "report.md").exists()
    rows = json.loads((run_dir / "bench" / "report.json").read_text())["rows"]
    rules = {
        (d, t): {
            r["rule"] for r in rows if r["method"] == "spec" and r["draft"] == d and r["temperature"] == t
        }
        for d in ("initial", "distilled")
        for t in (0.0, 1.0)
    }
    # initial: the before; at T = 0 every rule is argmax matching, one row a tree (speed.rules_at)
    assert rules == {
        ("initial", 0.0): {"greedy"},
        ("distilled", 0.0): {"greedy"},
        ("initial", 1.0): {"chain", "resispec"},
        ("distilled", 1.0): {"chain", "rrs"},
    }, rules
    assert "distillation: 10 steps" in out and "tokens/s" in out
    assert (run_dir / "distill" / "draft" / "config.json").exists()
    history = json.loads((Path(world.cache_dir) / "pipeline_times.json").read_text())
    assert {"debug/world_cached", "debug/distill", "debug/bench"} <= set(history)
    assert all(seconds >= 0 for seconds in history.values())


def test_a_head_beside_the_draft_trains_its_own_number_of_steps(tmp_path):
    """draft.head.beside: the pipeline also trains a head, on the draft's job with draft.kind=head under
    distill_head/; draft.head.max_steps (the tiny_head recipe's 600: a head starts from scratch) replaces the
    draft's train.max_steps for the head only."""
    from hydra import compose, initialize_config_dir

    from resispec.config import register_configs, to_typed
    from resispec.training import JOB_SECTIONS, DistillJob

    register_configs()
    beside = _pipeline_module().beside_head_job
    overrides = ([], ["draft.head.max_steps=4"], ["draft.head.beside=false"])
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfgs = [to_typed(compose("distill", ["+recipe=debug_head", *extra])) for extra in overrides]
    jobs = [
        DistillJob(**{k: getattr(c, k) for k in JOB_SECTIONS}, output_dir=tmp_path / "distill", name=c.name)
        for c in cfgs
    ]
    head = beside(jobs[0])
    assert head.draft.kind == "head" and jobs[0].draft.kind == "model"
    assert head.train.max_steps == jobs[0].train.max_steps == 10
    assert head.output_dir == tmp_path / "distill_head" and head.name == "debug_head_head"
    assert beside(jobs[1]).train.max_steps == 4 and jobs[1].train.max_steps == 10
    assert beside(jobs[2]) is None and beside(head) is None
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        tiny = to_typed(compose("distill", ["+recipe=tiny_head"]))
    assert (tiny.draft.head.max_steps, tiny.train.max_steps) == (600, 450)


def test_stage_clock_estimates_from_the_previous_run(tmp_path, capsys):
    stage_clock = _pipeline_module().StageClock
    stages = [("job/a", "first"), ("job/b", "second")]
    history = tmp_path / "cache" / "times.json"

    first = stage_clock(history, stages)
    first.start("job/a")
    assert "no earlier run here" in capsys.readouterr().out
    first.stop("job/a")
    first.start("job/b")
    first.stop("job/b")
    assert set(json.loads(history.read_text())) == {"job/a", "job/b"}

    history.write_text(json.dumps({"job/a": 120.0, "job/b": 60.0}))
    second = stage_clock(history, stages)
    second.start("job/a")
    assert "job time left ~3.0 min (this stage ~2.0 min" in capsys.readouterr().out
    second.stop("job/a")
    second.start("job/b")
    assert "job time left ~1.0 min" in capsys.readouterr().out

    with_default = stage_clock(tmp_path / "none.json", stages, defaults={"job/a": 0.0})
    with_default.start("job/a")
    assert "no earlier run here" in capsys.readouterr().out  # job/b was never timed
    with_default.past["job/b"] = 30.0
    with_default.start("job/a")
    assert "job time left ~0.5 min" in capsys.readouterr().out

    history.write_text("not json")  # a damaged history only loses the estimate
    third = stage_clock(history, stages)
    third.start("job/a")
    assert "no earlier run here" in capsys.readouterr().out
