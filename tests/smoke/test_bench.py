"""`bench/speed.py` on the micro world: every method runs and the three report files are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resispec.benchmark.config import BenchConfig
from resispec.benchmark.speed import run_bench
from resispec.decoding.config import DecodeConfig
from resispec.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)  # a whole bench subprocess: ~1-2 min alone, > 5 min when the 2 cores are shared
def test_bench_script_writes_report(micro_world, tmp_path):
    world, paths = micro_world
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "speed.py"),
        "+recipe=debug",
        f"world.cache_dir={world.cache_dir}",
        f"bench.output_dir={out}",
        "bench.num_prompts=2",
        "bench.max_new_tokens=8",
        "bench.rules=[chain,resispec]",
        "bench.trees=[[2,1]]",
        "bench.temperatures=[0.0,1.0]",
        "bench.plan_rules=[resispec]",
        "bench.plan_check_prompts=6",  # the plan's tau counted on 2 more test prompts
        "bench.reference_step=true",
        "logger.wandb.mode=offline",
        f"logger.wandb.dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        f"+bench.drafts={{second: '{paths.draft_dir}'}}",  # a second draft (the same weights, loaded again)
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert {"report.md", "report.json", "speedup.png"} <= {p.name for p in out.iterdir()}
    rows = json.loads((out / "report.json").read_text())["rows"]
    # per temperature: AR, AR on the HF forward (reference_step) + per draft (2 rules x 1 tree, lean and reference
    # step, + the planned tree of 1 rule + HF assisted chain 2); at T = 0 the one rule "greedy" (speed.rules_at)
    assert len(rows) == (2 + 2 * (1 * 2 + 1 + 1)) + (2 + 2 * (2 * 2 + 1 + 1))
    assert sum(r["method"] == "ar_ref" and 0 < r["speedup"] for r in rows) == 2
    assert sum(r["tree"] == "ref[2,1]" for r in rows) == 2 * (1 + 2)
    spec = [r for r in rows if r["method"] == "spec"]
    assert {t: {r["rule"] for r in spec if r["temperature"] == t} for t in (0, 1)} == {
        0: {"greedy"},
        1: {"chain", "resispec"},
    }
    assert {r["draft"] for r in rows} == {"-", "draft", "second"}
    for t in (0.0, 1.0):
        at = [r for r in rows if r["temperature"] == t]
        assert [r["method"] for r in at].count("ar") == 1 and at[0]["speedup"] == 1.0
        ar_tps = at[0]["tokens_per_second"]
        for r in at:
            assert r["num_tokens"] > 0 and r["tokens_per_second"] > 0
            assert abs(r["speedup"] - r["tokens_per_second"] / ar_tps) < 1e-9
            if r["method"] == "spec" and r["tree"].startswith(
                "auto"
            ):  # the planner's tree, with its prediction
                plan = r["stats"]["plan"]
                assert r["tree"] == "auto[" + ",".join(map(str, plan["tree"])) + "]"
                assert 1.0 <= plan["tau"] <= 1 + len(plan["tree"])  # at most every level accepted
                # timed again after the sweep, beside AR and its rule's best row
                h = r["stats"]["head_to_head"]
                assert h["best_fixed"] == "[2,1]" and h["speedup"] > 0 and h["repeats"] == 2
                ratio = pytest.approx(h["speedup"] / h["best_speedup"])
                assert h["ratio"] == (1.0 if h["same_tree"] else ratio)
                g = r["stats"]["pool"]  # tau counted on the bench's 4 prompts and 2 more
                assert (g["prompts"], g["timed_prompts"], g["best_fixed"]) == (6, h["prompts"], "[2,1]")
                chain = set(plan["tree"]) == {1}
                assert ("speedup" in g) == (t == 0.0 or chain)  # T > 0: chains only
                assert ("best_speedup" in g) == (t == 0.0)  # [2,1] is no chain
                if "speedup" in g:
                    assert 1.0 <= g["tau"] <= 1 + len(plan["tree"])
                    # carried over the tau the head-to-head's calls decoded
                    assert g["tau_decoded"] == pytest.approx(h["tau"]) and 1.0 <= h["tau"] <= 3
                    assert g["speedup"] == pytest.approx(h["speedup"] * g["tau"] / h["tau"])
            elif r["method"] == "spec":
                assert len(r["per_depth_acceptance"]) == 2 and r["c"] > 0
                # tau is tokens per verify forward, read from the row's own counters, and at most every level
                s = r["stats"]
                assert s["num_drafts"] > 0 and 0 <= s["num_accepted_tokens"] <= 2 * s["num_drafts"]
                assert r["tau"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"], abs=1e-9)
                assert s["accepted_per_position"][1] <= s["accepted_per_position"][0]  # depth 2 needs depth 1
                b = r["stats"]["breakdown"]  # host overhead against one AR token and the row's target forward
                assert abs(b["overhead_frac_of_target"] - b["overhead_ms"] / b["target_ms"]) < 1e-9
                assert abs(b["overhead_frac_of_ar_token"] - b["overhead_ms"] / b["ar_token_ms"]) < 1e-9
                if t == 0.0:  # greedy: every method emits the same tokens as AR
                    assert r["num_tokens"] == at[0]["num_tokens"]
    report = (out / "report.md").read_text()
    assert "| T | method |" in report and "Per-step breakdown" in report and "tree=auto" in report
    assert "| overhead / AR token | overhead / target fwd |" in report
    assert "tree=auto head-to-head, after the sweep" in report
    assert "tree=auto on 6 test prompts" in report
    assert set(rows[0]["stats"]["cost_model"]) == {"draft", "second"}  # target and draft ms vs tokens
    assert "tok/s" in proc.stdout and "speedup" in proc.stdout  # the rich table was printed
    assert list(tmp_path.glob("wandb/offline-run-*")), "no offline W&B run was written"


def test_bench_random_pair_needs_no_world(tmp_path):
    """bench.random_pair (the former decoding/profile.py --random): a random tiny-world-shaped pair, random prompts,
    the same harness and report; tau and c come from DecodeStats."""

    bench = BenchConfig(
        random_pair=True,
        num_prompts=1,
        warmup=0,
        max_new_tokens=4,
        temperatures=[1.0],
        rules=["chain"],
        trees=[[2, 1]],
        hf_assisted=False,
        plan_rules=[],
        output_dir=str(tmp_path),
    )
    missing = ModelConfig(path=str(tmp_path / "no_such_model"), device="cpu")  # never loaded
    rows = run_bench(bench, DecodeConfig(), missing, missing, progress=False, show=False)
    assert [r.method for r in rows] == ["ar", "spec"]
    assert rows[1].tau is not None and rows[1].c is not None
    s = rows[1].stats
    assert s["num_drafts"] > 0 and rows[1].tau == pytest.approx(
        1 + s["num_accepted_tokens"] / s["num_drafts"]
    )
    assert json.loads((tmp_path / "report.json").read_text())["meta"]["target"].startswith("random")


def test_experiment_script_runs_on_the_shared_opening(micro_world):
    """bench/experiments/greedy_blocks.py on the micro world: the opening the experiment scripts share
    (resispec.benchmark.experiment: --draft, Hydra overrides, the pair loaded) composes, loads and runs; every script
    built on it parses its options."""
    import importlib.util

    world, paths = micro_world

    def script(name: str):
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "experiments" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    overrides = ["+recipe=debug", f"world.cache_dir={world.cache_dir}"]
    text = script("greedy_blocks").main(
        [
            "--draft",
            str(paths.draft_dir),
            "--prompts",
            "4",
            "--block",
            "2",
            "--trees",
            "1,1",
            "2",
            "--",
            *overrides,
        ]
    )
    rows = [line for line in text.splitlines() if line.startswith("| test |") or line.startswith("| eval |")]
    assert len(rows) == 2 * 2  # two splits x two trees
    for name in ("batch_plan", "chain_tau", "h2h_noise", "plan_repeat", "remeasure_noise"):
        with pytest.raises(SystemExit) as exit_info:
            script(name).main(["--help"])
        assert exit_info.value.code == 0
