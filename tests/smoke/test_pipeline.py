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
        d: {r["rule"] for r in rows if r["method"] == "spec" and r["draft"] == d}
        for d in ("initial", "distilled")
    }
    assert rules == {"initial": {"chain", "resispec"}, "distilled": {"chain", "rrs"}}, (
        rules
    )  # initial: the before
    assert "distillation: 10 steps" in out and "tokens/s" in out
    assert (run_dir / "distill" / "draft" / "config.json").exists()
    history = json.loads((Path(world.cache_dir) / "pipeline_times.json").read_text())
    assert {"debug/world_cached", "debug/distill", "debug/bench"} <= set(history)
    assert all(seconds >= 0 for seconds in history.values())


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
