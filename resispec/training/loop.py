"""The accelerate distillation loop: `distill(...) -> DistillResult`.

One function runs single-process, under `torchrun` / `accelerate launch` (DDP), and with the FSDP / DeepSpeed
configs in recipes/accelerate. The data order is a pure function of (seed, step), and the model, optimizer,
scheduler, RNG and trainer state (step, loss curve, best tau) are saved together, so `train.resume=true`
reproduces the uninterrupted run's loss curve.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from resispec.data.config import DataConfig
from resispec.decoding.config import DecodeConfig
from resispec.losses import check_loss_config, describe_loss, distill_loss
from resispec.models.config import ModelConfig, WorldConfig
from resispec.training import checkpoint as ckpt
from resispec.training.config import LoggerConfig, LossConfig, OptimConfig, TrainConfig
from resispec.training.evaluation import closed_form_rules, eval_rule, evaluate, select_positions
from resispec.training.signal import attach_cache, build_cache, cache_key, cached_signal, online_signal
from resispec.training.tracking import RunLogger


class EmptyDatasetError(ValueError):
    """The training or held-out data has no response token to learn from."""


class DistillConfigError(ValueError):
    """A setting the run cannot honour (unknown loss, a rule without a closed form, ...)."""


# errors the entry script reports as one line (the user's to fix, not bugs); models adds its own two
USER_ERRORS: tuple[type[Exception], ...] = (EmptyDatasetError, DistillConfigError)


@dataclass
class DistillResult:
    output_dir: Path  # the run folder: draft/, metrics.json, config.yaml, checkpoints/, wandb/
    draft_dir: Path  # plain HF checkpoint (the best by held-out simulated tau)
    metrics: dict  # {"before": ..., "after": ..., "best_step": ...}
    adapter_dir: Path | None = None  # LoRA adapter (peft format), when draft.adapter=lora
    steps: int = 0
    num_processes: int = 1
    is_main: bool = True  # False on the other processes of a multi-process run (they print nothing)


@dataclass
class TrainerState:
    """What resume needs besides model / optimizer / RNG: registered with accelerate's checkpointing."""

    step: int = 0
    losses: list[float] = field(default_factory=list)  # mean training loss per optimizer step
    best_tau: float = -math.inf
    best_step: int = -1
    before: dict | None = None
    tokens: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def lr_lambda(optim: OptimConfig, max_steps: int):
    """Linear warmup, then cosine to 10% (or constant)."""

    def f(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        progress = (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def batch_indices(micro_step: int, batch_size: int, num_processes: int, rank: int, num_rows: int, seed: int):
    """Row indices of one process's micro-batch: a pure function of the micro-step, so resume replays the same
    stream. The global stream is the concatenation of per-epoch permutations (seed + epoch)."""
    start = micro_step * batch_size * num_processes + rank * batch_size
    out = []
    for pos in range(start, start + batch_size):
        epoch, i = divmod(pos, num_rows)
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        out.append(int(torch.randperm(num_rows, generator=g)[i]))
    return out


def _lora_wrap(model, draft_cfg: ModelConfig):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    modules = [m for m in draft_cfg.lora.target_modules if m in names]
    if not modules:
        raise DistillConfigError(
            f"none of lora.target_modules {draft_cfg.lora.target_modules} exist in the draft"
        )
    cfg = PeftLoraConfig(
        r=draft_cfg.lora.r,
        lora_alpha=draft_cfg.lora.alpha,
        lora_dropout=draft_cfg.lora.dropout,
        target_modules=modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def _pad_id(tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def _load_inputs(accelerator, world, target_cfg, draft_cfg, data_cfg, rows):
    """(target, draft, tokenizer, train rows, held-out rows), both models on this process's device; rows =
    (train, eval) skips regeneration. Regeneration is cached and split over the processes."""
    from resispec.models import load_pair

    device = str(accelerator.device)  # load each process's copy straight onto its own device
    target_cfg = dataclasses.replace(target_cfg, device=device) if target_cfg.device == "auto" else target_cfg
    draft_cfg = dataclasses.replace(draft_cfg, device=device) if draft_cfg.device == "auto" else draft_cfg
    target, draft, tok = load_pair(target_cfg, draft_cfg, world)
    target.to(accelerator.device).eval().requires_grad_(False)
    draft.to(accelerator.device)
    if rows is None:
        from resispec.data import ensure_regenerated

        rows = tuple(
            ensure_regenerated(
                data_cfg,
                target,
                tok,
                split,
                world,
                accelerator=accelerator,
                target_id=target_cfg.path,
                progress=accelerator.is_main_process,
                draft=draft,  # data.draft_fraction > 0: part of the training responses are the draft's
            )
            for split in ("train", "eval")
        )
    return target, draft, tok, rows[0], rows[1]


def _to_rows(ds) -> list[tuple[list[int], list[int]]]:
    return [(list(r["prompt_ids"]), list(r["response_ids"])) for r in ds]


def distill(
    world: WorldConfig,
    target: ModelConfig,
    draft: ModelConfig,
    data: DataConfig,
    decode: DecodeConfig,
    loss: LossConfig,
    optim: OptimConfig,
    train: TrainConfig,
    logger: LoggerConfig,
    output_dir: str | Path,
    name: str = "tiny",
    resolved_config: dict | None = None,
    rows=None,  # optional (train, eval) datasets of prompt_ids / response_ids (skips regeneration)
) -> DistillResult:
    """Distill (or LoRA-tune) the draft toward the target with the configured loss; evaluate held-out alpha /
    tau before, during and after; keep the best checkpoint by simulated tau. See recipes/ for how to launch."""
    threads = torch.get_num_threads()
    if train.num_threads:  # micro models on a shared CPU: one thread avoids contention that costs 10-50x
        torch.set_num_threads(train.num_threads)
    try:
        return _distill(
            world,
            target,
            draft,
            data,
            decode,
            loss,
            optim,
            train,
            logger,
            output_dir,
            name,
            resolved_config,
            rows,
        )
    finally:
        torch.set_num_threads(threads)


def _distill(
    world, target, draft, data, decode, loss, optim, train, logger, output_dir, name, resolved_config, rows
):
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    try:
        check_loss_config(loss, decode)
    except ValueError as e:
        raise DistillConfigError(str(e)) from e
    import logging

    logging.getLogger("accelerate").setLevel(logging.WARNING)  # per-file save_state INFO lines drown the bar
    on_cpu = target.device == "cpu" or not torch.cuda.is_available()
    accelerator = Accelerator(
        cpu=on_cpu,
        mixed_precision=train.mixed_precision,
        gradient_accumulation_steps=max(1, train.grad_accum),
    )
    is_main = accelerator.is_main_process
    set_seed(train.seed)

    # every process writes to the main one's folder (Hydra's ${now} can differ by a second between processes)
    run_dir = Path(_broadcast_str(accelerator, str(output_dir)))
    if train.resume:
        found = ckpt.find_resume_dir(run_dir)
        if found is None:
            accelerator.print(
                f"train.resume=true but no checkpoint under {run_dir} or its siblings: starting fresh"
            )
        else:
            run_dir = found
    ckpt_root = run_dir / "checkpoints"
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.clean_temporaries(ckpt_root)
        ckpt.clean_temporaries(run_dir)
    accelerator.wait_for_everyone()

    # ---- models and data
    target_model, draft_model, tok, train_ds, eval_ds = _load_inputs(
        accelerator, world, target, draft, data, rows
    )
    device = accelerator.device
    pad_id = _pad_id(tok)
    from resispec.data import pack

    packed = pack(train_ds, data.seq_len, pad_id).with_format("torch")
    if len(packed) == 0 or int(sum(int(r["loss_mask"].sum()) for r in packed)) == 0:
        raise EmptyDatasetError(
            "the training data has no response tokens (check data.source and regeneration)"
        )
    eval_seqs = select_positions(_to_rows(eval_ds), train.eval_positions)
    if not eval_seqs:
        raise EmptyDatasetError("the held-out data has no response tokens (check data.num_eval_prompts)")
    rules = closed_form_rules(sorted({int(n) for n in decode.tree}))
    pick_rule = eval_rule(decode.rule)
    if pick_rule not in rules:
        raise DistillConfigError(
            f"decode.rule {decode.rule!r} has no closed form to simulate tau; closed forms: {rules}"
        )

    if train.target_signal == "cached":
        from resispec.data import data_cache_dir
        from resispec.models import resolve_model_path

        # the resolved path names the world build (its config hash) for world:target
        target_id = resolve_model_path(target.path, world)
        key = cache_key(target_id, packed._fingerprint, train.cached_top_k, decode.temperature)
        cache_path = data_cache_dir(data, world) / "target_topk" / key

        def topk_cache(show_progress: bool):  # builds once (main process), then every process loads it
            return build_cache(
                target_model,
                packed,
                cache_path,
                train.cached_top_k,
                decode.temperature,
                train.batch_size,
                device,
                show_progress,
            )

        if is_main:
            topk_cache(True)
        accelerator.wait_for_everyone()
        packed = attach_cache(packed, topk_cache(False))
    elif train.target_signal != "online":
        raise DistillConfigError(f"train.target_signal must be online or cached, got {train.target_signal!r}")

    if draft.adapter not in ("none", "lora"):
        raise DistillConfigError(f"draft.adapter must be none or lora, got {draft.adapter!r}")
    if draft.adapter == "lora":
        draft_model = _lora_wrap(draft_model, draft)  # peft keeps the adapter weights in float32
    elif draft_model.dtype in (torch.bfloat16, torch.float16):
        # full training keeps float32 master weights (AdamW updates vanish in bf16); the forward still runs in
        # train.mixed_precision, and the exported draft is float32 (load it with draft.dtype=bfloat16 to serve)
        draft_model.float()
    draft_model.train()
    params = [p for p in draft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
    )
    # not prepared: accelerate would step a prepared scheduler once per process
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, train.max_steps))
    draft_model, optimizer = accelerator.prepare(draft_model, optimizer)
    state = TrainerState()
    accelerator.register_for_checkpointing(scheduler, state)

    steps_done = ckpt.checkpoint_steps(ckpt_root)
    if train.resume and steps_done:
        accelerator.load_state(str(ckpt.step_dir(ckpt_root, steps_done[-1])))
        accelerator.print(f"resumed from step {state.step} ({ckpt.step_dir(ckpt_root, steps_done[-1])})")

    if resolved_config is None:
        resolved_config = {
            "name": name,
            **{
                k: dataclasses.asdict(v)
                for k, v in (
                    ("world", world),
                    ("target", target),
                    ("draft", draft),
                    ("data", data),
                    ("decode", decode),
                    ("loss", loss),
                    ("optim", optim),
                    ("train", train),
                    ("logger", logger),
                )
            },
        }
    log = RunLogger(accelerator, logger, run_dir, name, resolved_config, resume=train.resume)
    # the wrapped model: under FSDP / ZeRO-3 only it can run a forward; every process evaluates the same data
    evaluate_now = lambda: evaluate(  # noqa: E731
        target_model, draft_model, eval_seqs, decode, rules, show_progress=is_main
    )
    if state.before is None:
        state.before = evaluate_now()
        log.log_eval("before", state.before, 0)
    _write_config(run_dir, resolved_config, is_main)

    # ---- the loop
    use_cache = train.target_signal == "cached"
    num_rows, ga = len(packed), max(1, train.grad_accum)
    bar = tqdm(total=train.max_steps, initial=state.step, desc=f"distill {name}", disable=not is_main)
    t_last, tok_last = time.perf_counter(), 0
    while state.step < train.max_steps:
        step_loss, step_tokens = 0.0, 0
        for a in range(ga):
            idx = batch_indices(
                state.step * ga + a,
                train.batch_size,
                accelerator.num_processes,
                accelerator.process_index,
                num_rows,
                train.seed,
            )
            batch = {k: v.to(device) for k, v in packed[idx].items()}
            # logits at t predict token t + 1: drop the last position, shift the mask
            mask = batch["loss_mask"][:, 1:]  # [B, T-1]
            # accumulate(): no gradient sync and no optimizer step until the last micro-batch (DDP, FSDP and
            # DeepSpeed alike); backward() divides by grad_accum
            with accelerator.accumulate(draft_model):
                logits = draft_model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                ).logits  # [B, T, V]
                sig = cached_signal(batch) if use_cache else online_signal(target_model, batch)
                sig.values = sig.values[:, :-1]
                sig.ids = None if sig.ids is None else sig.ids[:, :-1]
                value, stats = distill_loss(logits[:, :-1], sig, mask, loss, decode)
                accelerator.backward(value)
                if accelerator.sync_gradients and optim.grad_clip:
                    accelerator.clip_grad_norm_(draft_model.parameters(), optim.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += value.detach().float().item() / ga
            step_tokens += int(mask.sum())
        scheduler.step()
        state.step += 1
        ckpt.crash_hook("step", state.step)

        mean_loss = accelerator.reduce(torch.tensor([step_loss], device=device), "mean").item()
        tokens = int(accelerator.reduce(torch.tensor([step_tokens], device=device), "sum").item())
        state.losses.append(mean_loss)
        state.tokens += tokens
        tok_last += tokens
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.4f}")
        if state.step % logger.log_every == 0 or state.step == train.max_steps:
            now = time.perf_counter()
            log.log(
                {
                    "train/loss": mean_loss,
                    "train/fkl": stats["fkl"],
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/tokens_per_s": tok_last / max(now - t_last, 1e-9),
                    "train/tokens": state.tokens,
                },
                state.step,
            )
            t_last, tok_last = now, 0
        if (train.eval_every and state.step % train.eval_every == 0) or state.step == train.max_steps:
            metrics = evaluate_now()
            log.log_eval("eval", metrics, state.step)
            better = ckpt.sync_flag(accelerator, metrics["tau"][pick_rule] > state.best_tau)
            if better:
                state.best_tau, state.best_step = metrics["tau"][pick_rule], state.step
                ckpt.export_draft(accelerator, draft_model, tok, run_dir / "best", draft.adapter == "lora")
                if is_main:
                    ckpt.write_json_atomic(run_dir / "best_metrics.json", {"step": state.step, **metrics})
                if draft.adapter == "lora":
                    ckpt.export_adapter(accelerator, draft_model, run_dir / "best_adapter")
        if (train.save_every and state.step % train.save_every == 0) or state.step == train.max_steps:
            ckpt.save_state(accelerator, ckpt_root, state.step, train.keep_checkpoints)
    bar.close()

    # ---- the outputs: draft/ = best by held-out simulated tau
    if not ckpt.sync_flag(accelerator, (run_dir / "best").is_dir()):  # no training step ran (max_steps=0)
        metrics_now = evaluate_now()
        ckpt.export_draft(accelerator, draft_model, tok, run_dir / "best", draft.adapter == "lora")
        if draft.adapter == "lora":
            ckpt.export_adapter(accelerator, draft_model, run_dir / "best_adapter")
        if is_main:
            ckpt.write_json_atomic(run_dir / "best_metrics.json", {"step": state.step, **metrics_now})
    accelerator.wait_for_everyone()
    best_metrics = _read_json(run_dir / "best_metrics.json")
    if is_main and (run_dir / "best").is_dir():
        ckpt.copy_dir_atomic(run_dir / "best", run_dir / "draft")
        if draft.adapter == "lora" and (run_dir / "best_adapter").is_dir():
            ckpt.copy_dir_atomic(run_dir / "best_adapter", run_dir / "adapter")
    accelerator.wait_for_everyone()
    metrics = {
        "before": state.before,
        "after": {k: v for k, v in best_metrics.items() if k != "step"} if best_metrics else None,
        "best_step": state.best_step,
        "steps": state.step,
        "rule": pick_rule,
        "loss": describe_loss(loss, decode),
        "losses": state.losses,
        "num_processes": accelerator.num_processes,
        "tokens": state.tokens,
    }
    if is_main:
        ckpt.write_json_atomic(run_dir / "metrics.json", metrics)
        ckpt.update_latest(run_dir)
    log.summary(metrics)
    log.finish()
    accelerator.wait_for_everyone()
    return DistillResult(
        output_dir=run_dir,
        draft_dir=run_dir / "draft",
        metrics=metrics,
        adapter_dir=run_dir / "adapter" if draft.adapter == "lora" else None,
        steps=state.step,
        num_processes=accelerator.num_processes,
        is_main=is_main,
    )


def _broadcast_str(accelerator, value: str) -> str:
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def _read_json(path: Path) -> dict | None:
    import json

    return json.loads(path.read_text()) if path.exists() else None


def _write_config(run_dir: Path, resolved: dict | None, is_main: bool) -> None:
    if is_main and resolved is not None:
        import yaml

        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
