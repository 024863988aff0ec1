"""The parts of the prepared GPU check (scripts/gpu_check.sh runs each under its own timeout, then `report`).

    python scripts/gpu_check.py PART --out DIR [--dry-run]      PART: tests | world | distill | serve | report

$GPU_CHECK_CACHE_DIR, when set, is the world cache (world.cache_dir) of the world and serve parts.

Each part writes DIR/PART.json ({"part", "ok", "seconds", "summary", ...}); `report` merges them (and the shell's
exit codes, DIR/status.tsv) into DIR/gpu_check.json and DIR/gpu_check.md, which answer the two questions the CPU
could not: does the best tree beat the best chain by >= 1.1x when verifying 5-30 nodes costs about what one does,
and is p95 latency at 8 clients within 2x of a lone request. --dry-run runs every part on the CPU at micro /
stand-in sizes (the micro world, the recipe's shapes shrunk as the stand-in shrinks them), so the script is known
to work before a GPU sees it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "world", "distill", "serve")
# seconds per part on the GPU (scripts/gpu_check.sh holds them; the report states them): 8 minutes in all
BUDGETS = {"install": 45, "tests": 75, "world": 150, "distill": 110, "serve": 80, "report": 20}


def _run(cmd: list[str], log: Path, env: dict | None = None) -> int:
    with log.open("w") as f:
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- parts


def part_tests(out: Path, dry: bool) -> dict:
    """The gpu-marked tests (collected only on a dry run: without CUDA they skip)."""
    import xml.etree.ElementTree as ET

    files = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text()
    )
    xml = out / "gpu_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    cmd += ["--timeout=60", f"--junitxml={xml}", *files] + (["--collect-only"] if dry else [])
    rc = _run(cmd, out / "tests.log")
    summary = {"files": files, "rc": rc}
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        summary.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        summary["failed"] = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
    ok = rc in (0, 5) if dry else rc == 0  # 5: nothing collected/ran
    return {"ok": ok, "summary": summary}


def _world_overrides(dry: bool) -> list[str]:
    cache = (
        [f"world.cache_dir={os.environ['GPU_CHECK_CACHE_DIR']}"]
        if os.environ.get("GPU_CHECK_CACHE_DIR")
        else []
    )
    if dry:
        return ["+recipe=debug", "train.num_threads=1", *cache]
    return cache  # the tiny world (conf/world/tiny.yaml), built on first use on this device


def part_world(out: Path, dry: bool) -> dict:
    """The tiny world on CUDA: AR against every rule on a chain and on tree=auto (bench/speed.py), and the
    target's forward cost against 1-64 new tokens (the planner's forward table)."""
    bench_dir = out / "bench"
    if dry:
        extra = [
            "bench.rules=[resispec]",
            "bench.trees=[[1,1]]",
            "bench.plan_rules=[]",
            "bench.num_prompts=1",
        ]
        extra += ["bench.max_new_tokens=4", "bench.warmup=0", "bench.temperatures=[1.0]"]
    else:
        extra = ["bench.trees=[[1,1,1,1]]", "bench.num_prompts=3", "bench.max_new_tokens=48"]
    cmd = [sys.executable, "bench/speed.py", *_world_overrides(dry), f"bench.output_dir={bench_dir}"]
    cmd += ["bench.hf_assisted=false", "logger.wandb.mode=disabled", *extra]
    rc = _run(cmd, out / "world_bench.log")
    summary: dict = {"bench_rc": rc}
    report = bench_dir / "report.json"
    if report.exists():
        summary.update(_bench_summary(json.loads(report.read_text())["rows"]))
    summary["forward_ms"] = _forward_costs(dry)
    ratios = _cost_ratios(summary["forward_ms"])
    summary.update(ratios)
    return {"ok": rc == 0 and report.exists(), "summary": summary}


def _is_chain(tree: str) -> bool:
    """A bench row's tree label ("[1,1,1,1]", "auto[2,1]") is a chain when every branching is 1."""
    return set(tree.removeprefix("auto").strip("[]").replace(" ", "").split(",")) == {"1"}


def _best(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda r: r["speedup"]) if rows else None


def _bench_summary(rows: list[dict]) -> dict:
    """Per temperature: AR tokens/s, every rule's speedup over AR, the best chain row and the best tree row (a
    fixed or planned tree with a branching above 1), and their ratio."""
    out = {}
    for t in sorted({r["temperature"] for r in rows}):
        spec = [
            r
            for r in rows
            if r["temperature"] == t and r["method"] == "spec" and r.get("speedup") is not None
        ]
        bc = _best([r for r in spec if _is_chain(r["tree"])])
        bt = _best([r for r in spec if not _is_chain(r["tree"])])
        ar = next((r for r in rows if r["temperature"] == t and r["method"] == "ar"), None)
        out[f"T={t:g}"] = {
            "ar_tokens_per_s": ar and ar["tokens_per_second"],
            "rules": {f"{r['rule']} {r['tree']}": round(r["speedup"], 3) for r in spec},
            "best_chain": bc and {"row": f"{bc['rule']} {bc['tree']}", "speedup": round(bc["speedup"], 3)},
            "best_tree": bt and {"row": f"{bt['rule']} {bt['tree']}", "speedup": round(bt["speedup"], 3)},
            "tree_over_chain": round(bt["speedup"] / bc["speedup"], 3) if bt and bc else None,
        }
    return {"bench": out}


def _forward_costs(dry: bool) -> dict[int, float]:
    """Median ms of the target's cached forward over n new tokens (planner.forward_table), n = 1..64."""
    import torch
    from hydra import compose, initialize_config_dir

    from resispec.config import register_configs, to_typed
    from resispec.decoding.planner import forward_table
    from resispec.models import load_pair

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = to_typed(compose(config_name="bench", overrides=_world_overrides(dry)))
    target, _draft, _tok = load_pair(c.target, c.draft, c.world)
    nodes = [1, 2, 4] if dry else [1, 2, 4, 5, 8, 12, 16, 20, 24, 30, 32, 48, 64]
    with torch.no_grad():
        table = forward_table(target.eval(), nodes, reps=3 if dry else 7)
    return {int(n): round(float(ms), 4) for n, ms in table.items()}


def _cost_ratios(table: dict[int, float]) -> dict:
    one = table.get(1)
    if not one:
        return {}
    mid = [ms / one for n, ms in table.items() if 5 <= n <= 30]
    return {
        "cost_ratio_by_nodes": {n: round(ms / one, 3) for n, ms in table.items()},
        "max_cost_ratio_5_30": round(max(mid), 3) if mid else None,
    }


def part_distill(out: Path, dry: bool) -> dict:
    """A Llama-3.1-8B-shaped target and a Llama-3.2-1B-shaped draft, random weights in bf16 (dry run: the
    stand-in's shrunk shapes, float32 on the CPU), a few distillation steps at the recipe's per-device batch:
    step time, tokens/s, measured peak against the plan's per_device_gib for the same shapes."""
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from resispec.config import register_configs
    from resispec.models.hub_configs import shipped_config_dir
    from resispec.models.standin import DRAFT_SIZE, TARGET_SIZE, shrunk_config
    from resispec.training.loop import JOB_SECTIONS, DistillJob
    from resispec.training.measure import measure_step

    overrides = ["+recipe=llama3", "train.max_steps=4"]
    if dry:
        overrides += [
            "data.seq_len=64",
            "data.regen.max_new_tokens=32",
            "train.batch_size=1",
            "loss.chunk_size=16",
        ]
        overrides += [
            "train.mixed_precision=no",
            "target.device=cpu",
            "draft.device=cpu",
            "train.num_threads=1",
        ]
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = OmegaConf.to_object(compose(config_name="distill", overrides=overrides))
    device = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def build(path: str, size):
        from transformers import AutoConfig

        real = json.loads((shipped_config_dir(path) / "config.json").read_text())
        rest = _without(real, "architectures", "model_type", "torch_dtype")
        cfg = shrunk_config(real, size) if dry else AutoConfig.for_model(real["model_type"], **rest)
        cfg.architectures = list(real["architectures"])
        with torch.device(device):
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    target = build(c.target.path, TARGET_SIZE).eval().requires_grad_(False)
    draft = build(c.draft.path, DRAFT_SIZE)
    build_s = time.perf_counter() - t0
    job = DistillJob(**{k: getattr(c, k) for k in JOB_SECTIONS}, output_dir=str(out / "distill"), name=c.name)
    steps = 2 if dry else 4
    res = measure_step(job, (target, draft), steps=steps)
    res["build_s"] = round(build_s, 1)
    res["shapes"] = "stand-in (shrunk)" if dry else "Llama-3.1-8B + Llama-3.2-1B (random weights)"
    if dry:
        res["measured_gib"] = None  # the CPU's process peak is measured by train/memory_plan.py --measure
    else:
        res["measured_over_plan"] = round(res["measured_gib"] / res["predicted_gib"], 3)
    finite = all(math.isfinite(t) for t in res["step_times_s"])
    return {"ok": finite, "summary": res}


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys and k != "transformers_version"}


def part_serve(out: Path, dry: bool) -> dict:
    """The batched decoder and the server at 8 concurrent clients on the tiny world (the in-process comparison of
    bench/load.py: one-at-a-time and continuous batching, AR and speculative): p95 at 8 against a
    lone request."""
    load_dir = out / "load"
    if dry:
        extra = ["bench.concurrencies=[1,2]", "bench.num_requests=2", "bench.max_new_tokens=4"]
        extra += ["bench.modes=[batched AR]"]
    else:
        extra = ["bench.concurrencies=[1,8]", "bench.num_requests=16", "bench.max_new_tokens=64"]
        extra += ["bench.modes=[batched AR,batched spec,batched adaptive]"]
    cmd = [sys.executable, "bench/load.py", *_world_overrides(dry), f"bench.output_dir={load_dir}"]
    rc = _run(cmd + extra, out / "serve.log")
    sweep = load_dir / "sweep.json"
    summary: dict = {"rc": rc}
    if sweep.exists():
        res = json.loads(sweep.read_text())
        top = max(r["concurrency"] for r in res)
        by_label: dict = {}
        for r in res:
            by_label.setdefault(r.get("label") or r.get("url"), {})[r["concurrency"]] = r
        summary["p95_over_lone"] = {
            label: round(lv[top]["latency_p95"] / lv[1]["latency_p95"], 3)
            for label, lv in by_label.items()
            if 1 in lv and top in lv and lv[1]["latency_p95"]
        }
        summary["clients"] = top
        summary["tokens_per_s"] = {
            label: {c: round(r.get("tokens_per_second") or 0, 1) for c, r in lv.items()}
            for label, lv in by_label.items()
        }
    return {"ok": rc == 0 and sweep.exists(), "summary": summary}


# ---------------------------------------------------------------- report


def report(out: Path, dry: bool) -> dict:
    status = {}
    if (out / "status.tsv").exists():
        for line in (out / "status.tsv").read_text().splitlines():
            name, rc, seconds, budget = line.split("\t")
            status[name] = {"rc": int(rc), "seconds": float(seconds), "budget_s": int(budget)}
    parts = {}
    for name in PARTS:
        f = out / f"{name}.json"
        parts[name] = json.loads(f.read_text()) if f.exists() else {"ok": False, "summary": {"missing": True}}
        parts[name].update(status.get(name, {}))
        if status.get(name, {}).get("rc") in (124, 137):
            parts[name]["timed_out"] = True
    world = parts["world"].get("summary", {})
    trees = {t: v.get("tree_over_chain") for t, v in world.get("bench", {}).items()}
    serve = parts["serve"].get("summary", {})
    answers = {
        "tree_beats_chain_1_1x": {
            "tree_over_chain": trees,
            "max_cost_ratio_5_30": world.get("max_cost_ratio_5_30"),
            "answer": (
                any(v >= 1.1 for v in known)
                if (known := [v for v in trees.values() if v is not None])
                else None
            ),
        },
        "p95_at_8_within_2x": {
            "p95_over_lone": serve.get("p95_over_lone"),
            "answer": (
                all(v <= 2.0 for v in serve["p95_over_lone"].values()) if serve.get("p95_over_lone") else None
            ),
        },
    }
    doc = {
        "dry_run": dry,
        "device": _device(),
        "budgets_s": BUDGETS,
        "ok": all(p.get("ok") for p in parts.values()),
        "answers": answers,
        "parts": parts,
    }
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str))
    (out / "gpu_check.md").write_text(_markdown(doc))
    return doc


def _markdown(doc: dict) -> str:
    lines = [
        f"# resispec GPU check{' (dry run, CPU)' if doc['dry_run'] else ''}",
        "",
        f"Device: {doc['device']}. All parts ok: {doc['ok']}.",
        "",
        "| part | ok | rc | seconds | budget s |",
        "|---|---|---:|---:|---:|",
    ]
    for name, p in doc["parts"].items():
        lines.append(
            f"| {name} | {p.get('ok')}{' (timed out)' if p.get('timed_out') else ''} | {p.get('rc', '-')} | "
            f"{p.get('seconds', '-')} | {p.get('budget_s', doc['budgets_s'].get(name))} |"
        )
    a = doc["answers"]
    t, s = a["tree_beats_chain_1_1x"], a["p95_at_8_within_2x"]
    lines += [
        "",
        "## Answers",
        "",
        f"- Best tree over the best chain (per temperature; tree=auto rows included): {t['tree_over_chain']}; the target's forward over "
        f"5-30 new tokens costs at most {t['max_cost_ratio_5_30']}x one token's. Tree beats chain by >= 1.1x: "
        f"**{t['answer']}**.",
        f"- p95 latency at the top client count over a lone request: {s['p95_over_lone']}. Within 2x: "
        f"**{s['answer']}**.",
        "",
        "## Parts",
        "",
    ]
    for name, p in doc["parts"].items():
        lines += [
            f"### {name}",
            "",
            "```json",
            json.dumps(p.get("summary"), indent=1, default=str)[:6000],
            "```",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=[*PARTS, "report"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.part == "report":
        doc = report(out, args.dry_run)
        print((out / "gpu_check.md").read_text()[:3000])
        return 0 if doc["ok"] else 1
    t0 = time.perf_counter()
    fn = {"tests": part_tests, "world": part_world, "distill": part_distill, "serve": part_serve}[args.part]
    try:
        res = fn(out, args.dry_run)
    except Exception as e:  # the part's failure is a row of the report, not the end of the check
        import traceback

        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    res = {"part": args.part, "seconds": round(time.perf_counter() - t0, 1), **res}
    (out / f"{args.part}.json").write_text(json.dumps(res, indent=2, default=str))
    print(json.dumps({k: v for k, v in res.items() if k != "traceback"}, default=str)[:2000])
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
