"""The opening the `bench/experiments/` scripts share: an argument parser that takes a draft folder and Hydra
overrides of conf/distill.yaml (experiment_parser), and, the script having composed the config, its target and that
draft loaded (load_experiment); the planner's prompts (planner_prompts) and the result printed (printed)."""

from __future__ import annotations

import argparse
import dataclasses

from resispec.benchmark.config import BenchConfig
from resispec.data.prompts import load_heldout_prompts
from resispec.models import load_pair


def experiment_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser with the script's docstring as its help, `--draft` (required) and the positional Hydra overrides;
    the script adds its own options."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="a draft folder (a run's distill/draft) or world:draft")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/distill.yaml, e.g. +recipe=tiny")
    return ap


def load_experiment(cfg, draft: str):
    """(target, draft, tokenizer): the composed config's target (the script composes conf/distill.yaml with its
    overrides: resispec.config.compose_typed, the composition root) and the draft at `draft`, loaded as the bench
    loads them."""
    return load_pair(cfg.target, dataclasses.replace(cfg.draft, path=draft), cfg.world)


def planner_prompts(cfg, tokenizer) -> list[list[int]]:
    """The prompts the bench's planner calibrates on: bench.plan_calibration_prompts' default count of the
    validation split."""
    count = BenchConfig().plan_calibration_prompts
    return load_heldout_prompts(cfg.data, tokenizer, cfg.world, count, split="eval")


def printed(lines: list[str]) -> str:
    """An experiment's result, its markdown lines joined: printed, and returned (the script's main returns it)."""
    text = "\n".join(lines)
    print(text)
    return text
