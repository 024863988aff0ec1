"""train.target_signal=cached on 2 processes (torchrun + gloo on CPU, micro pair): every rank builds its share of
the top-K cache, the merged cache equals one process's build, the target is released before the first training
step, and the held-out evaluation (sharded over the ranks, from the target's precomputed log probs) matches one
process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.smoke.test_distill_resume import _free_port
from tests.unit.test_training_helpers import save_pair

ROOT = Path(__file__).resolve().parents[2]

# argv: pair dir, output dir, cache dir, repository root. Records per rank: which rows it built, whether the
# target was still alive at the first training step, the metrics.
RUNNER = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from tests.smoke.test_cached_signal_ranks import instrumented_run
info = instrumented_run(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
Path(sys.argv[2] + ".rank" + os.environ.get("RANK", "0") + ".json").write_text(json.dumps(info))
"""


def instrumented_run(pair_dir: Path, out: Path, cache_dir: Path) -> dict:
    """`run`, recording which rows this process built into the cache, whether the target was still alive at each
    training step, and the metrics."""
    import gc
    import weakref

    import resispec.training.loop as loop
    import resispec.training.signal as signal

    seen = {"built_rows": 0, "target_alive_at_step": []}
    build, load_inputs, train_step = signal.build_cache, loop._load_inputs, loop.train_step

    def counting_build(target, packed, *args, **kwargs):
        seen["built_rows"] += len(packed)
        return build(target, packed, *args, **kwargs)

    def remembering_load(*args, **kwargs):
        out = load_inputs(*args, **kwargs)
        seen["target"] = weakref.ref(out[0])
        return out

    def checking_step(run_):
        gc.collect()
        seen["target_alive_at_step"].append(seen["target"]() is not None or run_.target is not None)
        return train_step(run_)

    signal.build_cache, loop._load_inputs, loop.train_step = counting_build, remembering_load, checking_step
    try:
        result = run(pair_dir, out, cache_dir)
    finally:
        signal.build_cache, loop._load_inputs, loop.train_step = build, load_inputs, train_step
    seen.pop("target")
    return {**seen, "num_processes": result.num_processes, "before": result.metrics["before"]}


def run(pair_dir: Path, out: Path, cache_dir: Path):
    from resispec.data.config import DataConfig
    from resispec.decoding.config import DecodeConfig
    from resispec.models.config import ModelConfig, WorldConfig
    from resispec.training import DistillJob, distill
    from resispec.training.config import LoggerConfig, LossConfig, OptimConfig, TrainConfig, WandbConfig
    from tests.unit.test_training_helpers import sample_rows

    target, draft = pair_dir / "target", pair_dir / "draft"
    rows = (sample_rows(target, 16, seed=0), sample_rows(target, 5, seed=1))
    job = DistillJob(
        world=WorldConfig(),
        target=ModelConfig(path=str(target), device="cpu"),
        draft=ModelConfig(path=str(draft), device="cpu"),
        data=DataConfig(seq_len=32, cache_dir=str(cache_dir)),
        decode=DecodeConfig(tree=[2, 1]),
        loss=LossConfig(),
        optim=OptimConfig(lr=3e-3, warmup_steps=1),
        train=TrainConfig(
            num_threads=1,
            max_steps=2,
            batch_size=2,
            eval_every=2,
            save_every=0,
            eval_positions=60,
            target_signal="cached",
            cached_top_k=8,
        ),
        logger=LoggerConfig(wandb=WandbConfig(mode="disabled"), log_every=1),
        output_dir=out,
        name="cached",
        rows=rows,
    )
    return distill(job)


def _launch(prefix: list[str], root: Path, name: str) -> list[dict]:
    script = root / "runner.py"
    script.write_text(RUNNER)
    out, cache = root / name, root / f"cache_{name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*prefix, str(script), str(root / "pair"), str(out), str(cache), str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(p.read_text()) for p in sorted(root.glob(f"{name}.rank*.json"))]


def _cache(root: Path, name: str) -> tuple[Path, object]:
    import datasets

    (path,) = (root / f"cache_{name}" / "target_topk").iterdir()
    return path, datasets.load_from_disk(str(path)).with_format("torch")


@pytest.mark.slow  # 37-65 s on the 2-core machine: a 2-process torchrun launch plus the 1-process reference
@pytest.mark.timeout(600)
def test_cached_signal_is_built_by_every_rank_and_the_target_is_released(tmp_path):
    save_pair(tmp_path / "pair")
    one = [instrumented_run(tmp_path / "pair", tmp_path / "one", tmp_path / "cache_one")]  # in this process
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    two = _launch([*torchrun, "--master_port", str(_free_port())], tmp_path, "two")
    assert [r["num_processes"] for r in one] == [1] and [r["num_processes"] for r in two] == [2, 2]
    # every rank built its half of the 16 packed rows; one process built them all
    assert one[0]["built_rows"] == 16 and [r["built_rows"] for r in two] == [8, 8]
    path_one, cache_one = _cache(tmp_path, "one")
    path_two, cache_two = _cache(tmp_path, "two")
    assert path_one.name == path_two.name  # the same cache key: the same packed rows, target, K, temperature
    assert json.loads((path_two / "build.json").read_text())["rows_by_process"] == [8, 8]
    assert len(cache_one) == len(cache_two) == 16
    one_rows, two_rows = cache_one[:], cache_two[:]
    torch.testing.assert_close(two_rows["topk_logprobs"], one_rows["topk_logprobs"], atol=2e-3, rtol=0)
    same_ids = (two_rows["topk_ids"] == one_rows["topk_ids"]).float().mean().item()
    assert same_ids > 0.99, same_ids  # ties in the last bits may swap two ids
    # no process holds the target during its training steps
    assert all(r["target_alive_at_step"] == [False, False] for r in one + two)
    # the held-out evaluation, sharded over the ranks, equals one process's over all sequences
    for r in two:
        assert r["before"]["num_positions"] == one[0]["before"]["num_positions"]
        for rule, tau in one[0]["before"]["tau"].items():
            assert r["before"]["tau"][rule] == pytest.approx(tau, rel=1e-5), rule
        assert r["before"]["fkl"] == pytest.approx(one[0]["before"]["fkl"], rel=1e-5)
