"""`bash scripts/gpu_check.sh --dry-run`: every part of the prepared GPU check runs on the CPU at micro / stand-in
sizes and the report (JSON + markdown) comes out, so the script is known to work before a GPU ever sees it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_writes_the_report(tmp_path, micro_world):
    world, _paths = micro_world  # built once per session: the check's world and serve parts reuse it
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path / "check"), "GPU_CHECK_CACHE_DIR": world.cache_dir}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = tmp_path / "check"
    doc = json.loads((out / "gpu_check.json").read_text())
    failed = {k: v for k, v in doc["parts"].items() if not v.get("ok")}
    assert proc.returncode == 0 and not failed, (proc.stdout[-2000:], json.dumps(failed, default=str)[-3000:])
    assert doc["dry_run"] and set(doc["parts"]) == {"tests", "world", "distill", "serve"}
    assert "tests/gpu/test_decoding_gpu.py" in doc["parts"]["tests"]["summary"]["files"]
    assert (
        doc["parts"]["world"]["summary"]["forward_ms"] and doc["parts"]["serve"]["summary"]["p95_over_lone"]
    )
    assert doc["parts"]["distill"]["summary"]["predicted_gib"] > 0
    assert "## Answers" in (out / "gpu_check.md").read_text()
