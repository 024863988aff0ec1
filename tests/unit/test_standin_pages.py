"""The real recipes' pages (recipes/{llama3,llama3_lora,qwen3}/README.md) state their numbers from the config and
the memory plan, not from prose: each page holds a generated block (loss, batch, sequence length, steps, and the
plan's GiB per GPU for each shipped launch config) that must equal what the config and train/memory_plan.py give
today. After changing a recipe or the plan, refresh the blocks with:

    python tests/unit/test_standin_pages.py --write
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ("llama3", "llama3_lora", "qwen3")
LAUNCHES = ("single_gpu", "multi_gpu", "fsdp", "deepspeed_zero2")
BEGIN, END = "<!-- numbers: generated", "<!-- /numbers -->"
BLOCK = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)


def _memory_plan():
    spec = importlib.util.spec_from_file_location("memory_plan_script", ROOT / "train" / "memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(recipe: str):
    from hydra import compose, initialize_config_dir

    from resispec.config import register_configs, to_typed

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_typed(compose(config_name="distill", overrides=[f"+recipe={recipe}"]))


def _plan_gib(recipe: str, launch: str) -> float:
    args = [f"+recipe={recipe}", "--accelerate_config", f"recipes/accelerate/{launch}.yaml", "--json"]
    with contextlib.redirect_stdout(io.StringIO()):
        text = _memory_plan().main(args)
    return float(json.loads(text)["per_device_gib"])


def _run_length(t) -> str:
    parts = [
        f"{t.epochs:g} epochs" if t.epochs else None,
        f"at most {t.max_steps} steps" if t.max_steps else None,
    ]
    evals = (
        f"{t.num_evals} evaluations"
        if getattr(t, "num_evals", None)
        else f"an evaluation every {t.eval_every} steps"
    )
    return ", ".join(p for p in parts if p) + f"; {evals}"


def numbers_block(recipe: str) -> str:
    c = _config(recipe)
    t = c.train
    draft = f"{c.draft.path} (LoRA r={c.draft.lora.r})" if c.draft.adapter == "lora" else c.draft.path
    rows = [
        ("target / draft", f"{c.target.path} / {draft}"),
        ("loss", c.loss.name),
        ("batch per GPU x grad_accum", f"{t.batch_size} x {t.grad_accum}"),
        ("sequence length", str(c.data.seq_len)),
        ("run length", _run_length(t)),
        ("train / eval / bench split", f"{c.data.split} / {c.data.eval_split} / {c.data.test_split}"),
        ("held-out positions for the best checkpoint", str(t.eval_positions)),
    ]
    lines = [
        f"{BEGIN} from conf/recipe/{recipe}.yaml and train/memory_plan.py by tests/unit/test_standin_pages.py -->",
        "| setting | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows),
        "",
        "| launch (`recipes/accelerate/`) | GiB per GPU, memory plan |",
        "|---|---:|",
        *(f"| `{launch}.yaml` | {_plan_gib(recipe, launch):.1f} |" for launch in LAUNCHES),
        END,
    ]
    return "\n".join(lines)


def page(recipe: str) -> Path:
    return ROOT / "recipes" / recipe / "README.md"


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_page_numbers_come_from_the_config_and_the_plan(recipe):
    text = page(recipe).read_text()
    found = BLOCK.findall(text)
    assert len(found) == 1, f"{page(recipe)} needs one generated numbers block"
    want = numbers_block(recipe)
    assert found[0] == want, f"stale numbers; run python tests/unit/test_standin_pages.py --write\n{want}"
    # the prose around the block names the same loss, and the page shows the stand-in command that runs it
    assert f"loss `{_config(recipe).loss.name}`" in text
    assert f"python train/pipeline.py +recipe={recipe} standin=true" in text
    # ... with the very overrides the smoke test runs (tests/smoke/test_standin.py)
    from tests.smoke.test_standin import SHORT, SHORT_BENCH

    start = text.index(f"python train/pipeline.py +recipe={recipe} standin=true")
    command = text[start : text.index("```", start)].replace("\\\n", " ").replace("'", "").split()
    assert sorted(command[4:]) == sorted(o for o in SHORT + SHORT_BENCH if not o.startswith("logger."))
    assert len(text.splitlines()) <= 110


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit(__doc__)
    for name in RECIPES:
        path = page(name)
        path.write_text(BLOCK.sub(lambda _m, n=name: numbers_block(n), path.read_text(), count=1))
        print(f"updated {path}")
