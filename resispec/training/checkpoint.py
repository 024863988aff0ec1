"""Checkpoints: accelerate state for resume, plain HF drafts for everyone else, and the `latest` pointer.

Every folder is written under a temporary name and renamed into place, so a run killed at any moment leaves
either the previous complete checkpoint or the new complete one, never a half-written folder under a real name.
Only the main process renames, deletes or writes pointers.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
from pathlib import Path

import torch

from resispec.training.distributed import full_state_dict

STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"


def crash_hook(point: str, step: int) -> None:
    """Test hook: `RESISPEC_CRASH_AT=<point>:<step>` SIGKILLs this process there (point: `step` after the
    optimizer step, `save` in the middle of writing a checkpoint). A real kill, not an exception: nothing
    gets to clean up."""
    if os.environ.get("RESISPEC_CRASH_AT") == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_steps(ckpt_root: Path) -> list[int]:
    """Steps of the complete checkpoints under ckpt_root, ascending (temporary folders are ignored)."""
    if not ckpt_root.is_dir():
        return []
    return sorted(
        int(m.group(1)) for p in ckpt_root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()
    )


def step_dir(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f"step_{step:07d}"


def save_state(accelerator, ckpt_root: Path, step: int, keep: int) -> Path:
    """accelerator.save_state into a temporary folder, then rename to step_<step>; keep the `keep` newest."""
    final = step_dir(ckpt_root, step)
    tmp = ckpt_root / f"{TMP_PREFIX}{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # every process writes its own RNG state; weights from the main one
    accelerator.wait_for_everyone()
    crash_hook("save", step)
    if accelerator.is_main_process:
        (tmp / "COMPLETE").write_text(str(step))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoint_steps(ckpt_root)[:-keep] if keep > 0 else []:
            shutil.rmtree(step_dir(ckpt_root, old), ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def clean_temporaries(root: Path) -> None:
    """Remove leftovers of writes interrupted by a crash (main process only)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


def export_draft(
    accelerator, model, tokenizer, out_dir: Path, merge_lora: bool, dtype: torch.dtype | None = None
) -> Path:
    """Write the draft as a plain HF checkpoint (safetensors + tokenizer) at out_dir, atomically. A LoRA draft
    is merged into a copy of its base first, so the folder loads with AutoModelForCausalLM and no peft.
    dtype: the floating-point weights' dtype on disk (and config.json's `dtype`), e.g. the draft's training dtype
    bf16 where the run keeps float32 master weights; None = as the weights are."""
    state = full_state_dict(accelerator, model)  # gathers FSDP / ZeRO-3 shards; on every process
    if accelerator.is_main_process:
        tmp = out_dir.with_name(TMP_PREFIX + out_dir.name)
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        if merge_lora:
            merged = copy.deepcopy(unwrapped)
            merged.load_state_dict(state)
            plain = merged.merge_and_unload()
            if dtype is not None:
                plain.to(dtype)
            plain.save_pretrained(tmp, safe_serialization=True)
            del merged, plain
        else:
            if dtype is not None:
                state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            if dtype is not None:  # save_pretrained names the live (float32 master) weights' dtype
                config = json.loads((tmp / "config.json").read_text())
                config["dtype"] = str(dtype).removeprefix("torch.")
                (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir


def export_adapter(accelerator, model, out_dir: Path) -> Path:
    """Save a LoRA adapter (peft format) atomically; reload with PeftModel.from_pretrained(base, out_dir)."""
    state = full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        tmp = out_dir.with_name(TMP_PREFIX + out_dir.name)
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir


def copy_dir_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(TMP_PREFIX + dst.name)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(TMP_PREFIX + path.name)
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def update_latest(run_dir: Path) -> Path:
    """Point `<run_dir>/../latest` (a relative symlink) and `latest.json` at run_dir, so bench and the pipeline
    find the newest finished draft of a recipe: outputs/distill/<name>/latest/draft."""
    parent = run_dir.parent
    link = parent / "latest"
    tmp_link = parent / f"{TMP_PREFIX}latest-{os.getpid()}"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    os.symlink(run_dir.name, tmp_link)
    os.replace(tmp_link, link)
    write_json_atomic(
        parent / "latest.json",
        {"run_dir": str(run_dir.resolve()), "draft": str((run_dir / "draft").resolve())},
    )
    return link


def find_resume_dir(run_dir: Path) -> Path | None:
    """The run folder to resume: run_dir itself if it has checkpoints, else the newest sibling run folder
    (same recipe, earlier time) that has one."""
    if checkpoint_steps(run_dir / "checkpoints"):
        return run_dir
    parent = run_dir.parent
    if not parent.is_dir():
        return None
    candidates = [
        p
        for p in parent.iterdir()
        if p.is_dir() and not p.is_symlink() and checkpoint_steps(p / "checkpoints")
    ]
    return max(candidates, key=lambda p: p.name) if candidates else None


def sync_flag(accelerator, flag: bool) -> bool:
    """The main process's decision, broadcast to all (e.g. whether a checkpoint is the new best)."""
    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast

        t = broadcast(t, from_process=0)
    return bool(t.item() > 0.5)
