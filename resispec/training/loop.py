"""The accelerate distillation loop: `distill(job: DistillJob) -> DistillResult`.

One function runs single-process, under `torchrun` / `accelerate launch` (DDP), and with the FSDP / DeepSpeed
configs in recipes/accelerate. The data order is a pure function of (seed, step), and the model, optimizer,
scheduler, RNG and trainer state (step, loss curve, best tau) are saved together, so `train.resume=true`
reproduces the uninterrupted run's loss curve.

Reading order: `distill` (the loop), then its four steps: `_setup(job) -> _Run`, `train_step(run) -> StepStats`,
`_evaluate_and_keep_best(run)`, `_export(run) -> DistillResult`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from resispec.data import data_cache_dir, ensure_regenerated, pack
from resispec.data.config import DataConfig
from resispec.data.packing import trim_padding
from resispec.decoding.config import DecodeConfig
from resispec.errors import UserError
from resispec.losses import (
    TargetSignal,
    check_loss_config,
    describe_loss,
    distill_loss_rows,
    loss_weights,
    model_rows,
    response_index,
)
from resispec.models import load_model, load_pair, load_tokenizer, resolve_model_path
from resispec.models.config import ModelConfig, WorldConfig
from resispec.models.pretraining import resolve_mixed_precision
from resispec.training import checkpoint as ckpt
from resispec.training.config import LoggerConfig, LossConfig, OptimConfig, TrainConfig
from resispec.training.distributed import (
    LaunchError,
    is_fsdp,
    local_param_numel,
    make_accelerator,
    materialize_optimizer_state,
)
from resispec.training.evaluation import (
    closed_form_rules,
    eval_rule,
    evaluate_sharded,
    select_positions,
    shard_sequences,
    target_eval_logprobs,
)
from resispec.training.head_step import build_head, check_head_job, evaluate_head, head_micro_batch_loss
from resispec.training.memory_plan import check_fits, run_plan
from resispec.training.schedule import resolve_schedule
from resispec.training.signal import attach_cache, build_cache_sharded, cache_key, cached_signal
from resispec.training.tracking import RunLogger


class EmptyDatasetError(UserError, ValueError):
    """The training or held-out data has no response token to learn from."""


class DistillConfigError(UserError, ValueError):
    """A setting the run cannot honour (unknown loss, a rule without a closed form, ...)."""


# errors the entry script reports as one line (the user's to fix, not bugs); models adds its own two
USER_ERRORS: tuple[type[Exception], ...] = (EmptyDatasetError, DistillConfigError, LaunchError)

# the typed config sections a job holds, in the order of the root config (and of config.yaml)
JOB_SECTIONS = ("world", "target", "draft", "data", "decode", "loss", "optim", "train", "logger")


@dataclass(frozen=True)
class DistillJob:
    """Everything one distillation run needs: the nine typed config sections, where to write, and optionally the
    data (skipping regeneration). Narrow on purpose: never the root config. From a root config `c`:
    `DistillJob(**{k: getattr(c, k) for k in JOB_SECTIONS}, output_dir=..., name=c.name)`."""

    world: WorldConfig
    target: ModelConfig
    draft: ModelConfig
    data: DataConfig
    decode: DecodeConfig
    loss: LossConfig
    optim: OptimConfig
    train: TrainConfig
    logger: LoggerConfig
    output_dir: str | Path
    name: str = "tiny"
    resolved_config: dict | None = None  # written as config.yaml; None = the sections above
    rows: tuple[Any, Any] | None = None  # (train, eval) datasets of prompt_ids / response_ids

    def config_snapshot(self) -> dict:
        """What config.yaml and the tracker record: the resolved Hydra config, or the typed sections."""
        if self.resolved_config is not None:
            return self.resolved_config
        return {"name": self.name, **{k: dataclasses.asdict(getattr(self, k)) for k in JOB_SECTIONS}}


@dataclass
class DistillResult:
    output_dir: Path  # the run folder: draft/, metrics.json, config.yaml, checkpoints/, wandb/
    draft_dir: Path  # plain HF checkpoint (the best by held-out simulated tau)
    metrics: dict  # {"before": ..., "after": ..., "best_step": ...}
    adapter_dir: Path | None = None  # LoRA adapter (peft format), when draft.adapter=lora
    steps: int = 0
    num_processes: int = 1
    is_main: bool = True  # False on the other processes of a multi-process run (they print nothing)
    distributed_type: str = "NO"  # accelerate's: NO, MULTI_CPU / MULTI_GPU (DDP), FSDP, DEEPSPEED
    param_numel: tuple[int, int] = (0, 0)  # (draft parameter elements this process holds, the draft's total)


@dataclass
class TrainerState:
    """What resume needs besides model / optimizer / RNG: registered with accelerate's checkpointing."""

    step: int = 0
    losses: list[float] = field(default_factory=list)  # mean training loss per optimizer step
    best_tau: float = -math.inf
    best_step: int = -1
    before: dict | None = None
    tokens: int = 0
    step_seconds: float = 0.0  # wall time inside optimizer steps (evaluation and checkpoints excluded)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


@dataclass
class StepStats:
    """One optimizer step, averaged over the processes."""

    loss: float  # mean training loss
    fkl: float  # forward KL of the last micro-batch (this process), for monitoring
    tokens: int  # response tokens of the global batch


@dataclass
class _Run:
    """The live state of one run, built by `_setup` and threaded through the steps."""

    job: DistillJob
    accelerator: Any  # accelerate.Accelerator
    run_dir: Path
    target: torch.nn.Module | None  # frozen, never prepared (not sharded); None once released (cached signal)
    draft: torch.nn.Module  # prepared: DDP / FSDP / DeepSpeed-wrapped
    tokenizer: Any
    packed: Any  # datasets.Dataset (torch format): input_ids, attention_mask, loss_mask [+ cached top-K]
    eval_seqs: list
    rules: list[str]  # rules with a closed form, simulated at every evaluation
    pick_rule: str  # the rule whose tau picks the best checkpoint
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    state: TrainerState
    log: RunLogger
    param_numel: tuple[int, int]  # (held by this process, total): a shard under FSDP
    export_dtype: torch.dtype | None = None  # the draft's dtype as loaded (bf16 in the real recipes): exports
    eval_target: list | None = None  # cached signal: the target's held-out log probs of this process's share

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def lora(self) -> bool:
        return self.job.draft.adapter == "lora"


def distill(job: DistillJob) -> DistillResult:
    """Distill (or LoRA-tune) the draft toward the target with the configured loss; evaluate held-out alpha /
    tau before, during and after; keep the best checkpoint by simulated tau. See recipes/ for how to launch."""
    threads = torch.get_num_threads()
    if job.train.num_threads:  # micro models on a shared CPU: one thread avoids contention that costs 10-50x
        torch.set_num_threads(job.train.num_threads)
    try:
        run = _setup(job)
        train, every = run.job.train, job.logger.log_every  # the resolved schedule (resolve_schedule)
        due = lambda n: (n and run.state.step % n == 0) or run.state.step == train.max_steps  # noqa: E731
        bar = tqdm(
            total=train.max_steps, initial=run.state.step, desc=f"distill {job.name}", disable=not run.is_main
        )
        t_last, tok_last = time.perf_counter(), 0
        while run.state.step < train.max_steps:
            t_step = time.perf_counter()
            stats = train_step(run)
            run.state.step_seconds += time.perf_counter() - t_step
            tok_last += stats.tokens
            bar.update(1)
            bar.set_postfix(
                loss=f"{stats.loss:.4f}", tok_s=f"{stats.tokens / (time.perf_counter() - t_step):.0f}"
            )
            if due(every):
                now = time.perf_counter()
                run.log.log(
                    {
                        "train/loss": stats.loss,
                        "train/fkl": stats.fkl,
                        "train/lr": run.scheduler.get_last_lr()[0],
                        "train/tokens_per_s": tok_last / max(now - t_last, 1e-9),
                        "train/tokens": run.state.tokens,
                    },
                    run.state.step,
                )
                t_last, tok_last = now, 0
            if due(train.eval_every):
                _evaluate_and_keep_best(run)
            if due(train.save_every):
                ckpt.save_state(run.accelerator, run.ckpt_root, run.state.step, train.keep_checkpoints)
        bar.close()
        return _export(run)
    finally:
        torch.set_num_threads(threads)


# ---- 1. setup


def _setup(job: DistillJob) -> _Run:
    """Accelerator, run folder (resume), models, data, target signal, draft + optimizer, resumed state, logger,
    and the `before` evaluation."""
    from accelerate.utils import set_seed

    _check_job(job)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # per-file save_state INFO lines drown the bar
    accelerator = job_accelerator(job)
    set_seed(job.train.seed)
    run_dir = _resolve_run_dir(accelerator, job)

    target, draft, tok, train_ds, eval_ds = _load_inputs(
        accelerator, job.world, job.target, job.draft, job.data, job.rows
    )
    export_dtype = draft.dtype  # before float32 master weights: draft/ and best/ are written in it
    check_fits(run_plan(job, accelerator, target, draft), accelerator.device, job.train.force_memory)
    packed, eval_seqs = _pack(job, train_ds, eval_ds, _pad_id(tok))
    train, optim, schedule = resolve_schedule(job.train, job.optim, len(packed), accelerator.num_processes)
    job = dataclasses.replace(job, train=train, optim=optim)  # steps, cadences and warmup in optimizer steps
    accelerator.print(f"[schedule] {schedule}")
    rules = closed_form_rules(sorted({int(n) for n in job.decode.fixed_tree}))
    pick_rule = eval_rule(job.decode.rule)
    if pick_rule not in rules:
        raise DistillConfigError(
            f"decode.rule {job.decode.rule!r} has no closed form to simulate tau; closed forms: {rules}"
        )
    eval_target = None
    if job.train.target_signal == "cached":
        packed = _attach_target_cache(accelerator, job, target, packed)
        eval_target, target = _release_target(accelerator, job, target, eval_seqs), None

    draft, optimizer, scheduler, param_numel = prepare_draft(accelerator, job, draft)
    state = TrainerState()
    accelerator.register_for_checkpointing(scheduler, state)
    steps_done = ckpt.checkpoint_steps(run_dir / "checkpoints")
    if job.train.resume and steps_done:
        last = ckpt.step_dir(run_dir / "checkpoints", steps_done[-1])
        if is_fsdp(accelerator):
            materialize_optimizer_state(optimizer)  # else the sharded optimizer state loads into nothing
        accelerator.load_state(str(last))
        accelerator.print(f"resumed from step {state.step} ({last})")

    snapshot = job.config_snapshot()
    log = RunLogger(accelerator, job.logger, run_dir, job.name, snapshot, resume=job.train.resume)
    run = _Run(
        job,
        accelerator,
        run_dir,
        target,
        draft,
        tok,
        packed,
        eval_seqs,
        rules,
        pick_rule,
        optimizer,
        scheduler,
        state,
        log,
        param_numel,
        export_dtype,
        eval_target,
    )
    if state.before is None:
        state.before = _evaluate(run)
        log.log_eval("before", state.before, 0)
    if run.is_main:
        import yaml

        (run_dir / "config.yaml").write_text(yaml.safe_dump(snapshot, sort_keys=False))
    return run


def _check_job(job: DistillJob) -> None:
    """The settings that can be refused before any model loads."""
    try:
        check_loss_config(job.loss, job.decode)
    except ValueError as e:
        raise DistillConfigError(str(e)) from e
    if job.train.target_signal not in ("online", "cached"):
        raise DistillConfigError(
            f"train.target_signal must be online or cached, got {job.train.target_signal!r}"
        )
    if job.draft.adapter not in ("none", "lora"):
        raise DistillConfigError(f"draft.adapter must be none or lora, got {job.draft.adapter!r}")
    if job.draft.kind == "head":  # a draft head (resispec/training/head_step.py)
        check_head_job(job)


def job_accelerator(job: DistillJob):
    on_cpu = job.target.device == "cpu" or not torch.cuda.is_available()
    precision = job.train.mixed_precision
    if precision == "auto":
        precision = resolve_mixed_precision("auto", "cpu" if on_cpu else "cuda")
    return make_accelerator(
        on_cpu,
        precision,
        max(1, job.train.grad_accum),
        batch_size=job.train.batch_size,
        grad_clip=job.optim.grad_clip,
        timeout_minutes=job.train.process_group_timeout_min,
    )


def _resolve_run_dir(accelerator, job: DistillJob) -> Path:
    """The main process's output folder (Hydra's ${now} can differ by a second between processes), or with
    train.resume the run folder holding the newest checkpoint; temporaries of a crashed write are removed."""
    run_dir = Path(_broadcast_str(accelerator, str(job.output_dir)))
    if job.train.resume:
        found = ckpt.find_resume_dir(run_dir)
        if found is None:
            accelerator.print(
                f"train.resume=true but no checkpoint under {run_dir} or its siblings: starting fresh"
            )
        else:
            run_dir = found
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.clean_temporaries(run_dir / "checkpoints")
        ckpt.clean_temporaries(run_dir)
    accelerator.wait_for_everyone()
    return run_dir


def _pack(job: DistillJob, train_ds, eval_ds, pad_id: int):
    """(packed training rows in torch format, held-out sequences); refuses data without response tokens."""
    packed = pack(train_ds, job.data.seq_len, pad_id).with_format("torch")
    if len(packed) == 0 or int(sum(int(r["loss_mask"].sum()) for r in packed)) == 0:
        raise EmptyDatasetError(
            "the training data has no response tokens (check data.source and regeneration)"
        )
    eval_seqs = select_positions(_to_rows(eval_ds), job.train.eval_positions)
    if not eval_seqs:
        raise EmptyDatasetError("the held-out data has no response tokens (check data.num_eval_prompts)")
    return packed, eval_seqs


def _attach_target_cache(accelerator, job: DistillJob, target, packed):
    """The packed rows with the target's cached top-K log-probs: every process builds its share of the rows, the
    main process merges them (build_cache_sharded); loaded by all."""
    target_id = resolve_model_path(job.target.path, job.world)  # names the world build (its config hash)
    key = cache_key(target_id, packed._fingerprint, job.train.cached_top_k, job.decode.temperature)
    path = data_cache_dir(job.data, job.world) / "target_topk" / key
    top_k, temperature = job.train.cached_top_k, job.decode.temperature
    cache = build_cache_sharded(
        accelerator,
        target,
        packed,
        path,
        top_k,
        temperature,
        job.train.batch_size,
        accelerator.is_main_process,
    )
    return attach_cache(packed, cache)


def _release_target(accelerator, job: DistillJob, target, eval_seqs) -> list:
    """Cached signal: the target's last work (its held-out log probs for this process's share of the evaluation,
    on the CPU), then drop it so the training steps run without it. The caller drops its own reference."""
    import gc

    mine = eval_seqs
    if accelerator.num_processes > 1:
        mine, _ = shard_sequences(eval_seqs, accelerator.process_index, accelerator.num_processes)
    out = target_eval_logprobs(target, mine, job.decode, show_progress=accelerator.is_main_process)
    del target
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def prepare_draft(accelerator, job: DistillJob, draft):
    """(prepared draft, optimizer, scheduler, (parameter elements held here, total)): LoRA-wrapped or float32
    master weights, AdamW, the schedule."""
    if job.draft.adapter == "lora":
        draft = _lora_wrap(draft, job.draft)  # peft keeps the adapter weights in float32
    elif draft.dtype in (torch.bfloat16, torch.float16):
        # full training keeps float32 master weights (AdamW updates vanish in bf16); the forward still runs in
        # train.mixed_precision, and the exported draft is in the dtype it was loaded in (_Run.export_dtype)
        draft.float()
    draft.train()
    optim = job.optim
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
    )
    # not prepared: accelerate would step a prepared scheduler once per process
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, job.train.max_steps))
    total = sum(p.numel() for p in draft.parameters())
    draft, optimizer = accelerator.prepare(draft, optimizer)
    return draft, optimizer, scheduler, (local_param_numel(draft), total)


# ---- 2. one training step


def train_step(run: _Run) -> StepStats:
    """One optimizer step over grad_accum micro-batches of this process's share of the global batch."""
    acc, job, state = run.accelerator, run.job, run.state
    ga = max(1, job.train.grad_accum)
    step_loss, step_tokens, fkl = 0.0, 0, 0.0
    for a in range(ga):
        idx = batch_indices(
            state.step * ga + a,
            job.train.batch_size,
            acc.num_processes,
            acc.process_index,
            len(run.packed),
            job.train.seed,
        )
        batch = {k: v.to(acc.device) for k, v in run.packed[idx].items()}
        mask = batch["loss_mask"][:, 1:]  # [B, T-1]: logits at t predict token t + 1
        # accumulate(): no gradient sync and no optimizer step until the last micro-batch (DDP, FSDP and
        # DeepSpeed alike); backward() divides by grad_accum
        with acc.accumulate(run.draft):
            value, stats = micro_batch_loss(run, batch, mask)
            acc.backward(value)
            if acc.sync_gradients and job.optim.grad_clip:
                acc.clip_grad_norm_(run.draft.parameters(), job.optim.grad_clip)
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        step_loss += value.detach().float().item() / ga
        step_tokens += int(mask.sum())
        fkl = stats["fkl"]
    run.scheduler.step()
    state.step += 1
    ckpt.crash_hook("step", state.step)
    mean_loss = acc.reduce(torch.tensor([step_loss], device=acc.device), "mean").item()
    tokens = int(acc.reduce(torch.tensor([step_tokens], device=acc.device), "sum").item())
    state.losses.append(mean_loss)
    state.tokens += tokens
    return StepStats(loss=mean_loss, fkl=fkl, tokens=tokens)


def micro_batch_loss(run: _Run, batch: dict[str, torch.Tensor], mask: torch.Tensor):
    """(loss, stats) of one micro-batch: the draft's (and the online target's) logits at the response positions
    only, against the online or cached target signal, the loss over them in chunks (resispec.losses). Rows are
    trimmed to the batch's longest first (right padding: nothing before it changes)."""
    acc, job = run.accelerator, run.job
    batch = trim_padding(batch)
    mask = mask[:, : batch["input_ids"].shape[1] - 1]  # logits at t predict token t + 1
    if job.draft.kind == "head":
        return head_micro_batch_loss(run, batch, mask)
    index = response_index(mask, batch["input_ids"].shape[1])
    # a sharded draft gathers its head only inside its forward: there the forward computes the rows' logits
    fused = not is_fsdp(acc) and acc.distributed_type.value != "DEEPSPEED"
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(acc.mixed_precision))
    draft = model_rows(run.draft, acc.unwrap_model(run.draft), batch, index, fused, half)
    if job.train.target_signal == "cached":
        sig = cached_signal(batch)
        sel = mask.bool()
        sig = TargetSignal(sig.values[:, :-1][sel], sig.ids[:, :-1][sel])
    else:  # the target's forward is most of a step: it runs under the run's mixed precision as the draft's does
        with acc.autocast(), torch.no_grad():
            sig = TargetSignal(model_rows(run.target, run.target, batch, index, True, half))
    weights = loss_weights(mask, job.loss, job.decode)[mask.bool()]
    return distill_loss_rows(draft, sig, weights, job.loss, job.decode)


# ---- 3. evaluate and keep the best


def _evaluate(run: _Run) -> dict:
    # a head: each depth scored by its own unroll step (resispec/training/head_step.py)
    if run.job.draft.kind == "head":
        return evaluate_head(run)
    # the wrapped draft: under FSDP / ZeRO-3 only it can run a forward; each process evaluates its share
    return evaluate_sharded(
        run.accelerator,
        run.target,
        run.draft,
        run.eval_seqs,
        run.job.decode,
        run.rules,
        show_progress=run.is_main,
        target_logprobs=run.eval_target,
    )


def _evaluate_and_keep_best(run: _Run) -> None:
    """Held-out alpha / tau now; if tau (of the picking rule) beats the best so far, export the draft as best/."""
    metrics = _evaluate(run)
    run.log.log_eval("eval", metrics, run.state.step)
    tau = metrics["tau"][run.pick_rule]
    if ckpt.sync_flag(run.accelerator, tau > run.state.best_tau):  # the main process decides for all
        run.state.best_tau, run.state.best_step = tau, run.state.step
        _export_best(run, metrics)


def _export_best(run: _Run, metrics: dict) -> None:
    """best/ (plain HF draft), best_adapter/ (LoRA) and best_metrics.json for the current weights."""
    acc, run_dir = run.accelerator, run.run_dir
    ckpt.export_draft(acc, run.draft, run.tokenizer, run_dir / "best", run.lora, run.export_dtype)
    if run.lora:
        ckpt.export_adapter(acc, run.draft, run_dir / "best_adapter")
    if run.is_main:
        ckpt.write_json_atomic(run_dir / "best_metrics.json", {"step": run.state.step, **metrics})


# ---- 4. export


def _export(run: _Run) -> DistillResult:
    """draft/ (and adapter/) = the best by held-out simulated tau; metrics.json; the `latest` pointer."""
    acc, run_dir, state = run.accelerator, run.run_dir, run.state
    if not ckpt.sync_flag(acc, (run_dir / "best").is_dir()):  # no training step ran (max_steps=0)
        _export_best(run, _evaluate(run))
    acc.wait_for_everyone()
    best_path = run_dir / "best_metrics.json"
    best = json.loads(best_path.read_text()) if best_path.exists() else None
    if run.is_main and (run_dir / "best").is_dir():
        ckpt.copy_dir_atomic(run_dir / "best", run_dir / "draft")
        if run.lora and (run_dir / "best_adapter").is_dir():
            ckpt.copy_dir_atomic(run_dir / "best_adapter", run_dir / "adapter")
    acc.wait_for_everyone()
    metrics = {
        "before": state.before,
        "after": {k: v for k, v in best.items() if k != "step"} if best else None,
        "best_step": state.best_step,
        "steps": state.step,
        "rule": run.pick_rule,
        "loss": describe_loss(run.job.loss, run.job.decode),
        "losses": state.losses,
        "num_processes": acc.num_processes,
        "distributed_type": acc.distributed_type.value,
        "tokens": state.tokens,
        # the distillation step's throughput: response tokens (the positions the loss reads) per second of
        # optimizer steps, over all processes; evaluation and checkpoint time excluded
        "train_step_seconds": round(state.step_seconds, 4),
        "train_tokens_per_s": round(state.tokens / state.step_seconds, 1) if state.step_seconds else None,
    }
    if run.is_main:
        ckpt.write_json_atomic(run_dir / "metrics.json", metrics)
        ckpt.update_latest(run_dir)
    run.log.summary(metrics)
    run.log.finish()
    acc.wait_for_everyone()
    return DistillResult(
        output_dir=run_dir,
        draft_dir=run_dir / "draft",
        metrics=metrics,
        adapter_dir=run_dir / "adapter" if run.lora else None,
        steps=state.step,
        num_processes=acc.num_processes,
        is_main=run.is_main,
        distributed_type=acc.distributed_type.value,
        param_numel=run.param_numel,
    )


# ---- helpers


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
    (train, eval) skips regeneration. Regeneration is cached and split over the processes; with
    data.regen.engine=vllm it runs first, before any HF weights load (vLLM takes the GPUs while it runs)."""
    if rows is None and data_cfg.regen.engine == "vllm" and data_cfg.draft_fraction <= 0:
        tok, model_dir = load_tokenizer(target_cfg, world), resolve_model_path(target_cfg.path, world)
        rows = tuple(
            ensure_regenerated(
                data_cfg,
                None,
                tok,
                split,
                world,
                accelerator=accelerator,
                target_id=target_cfg.path,
                progress=accelerator.is_main_process,
                model_dir=model_dir,
            )
            for split in ("train", "eval")
        )
    device = str(accelerator.device)  # load each process's copy straight onto its own device
    target_cfg = dataclasses.replace(target_cfg, device=device) if target_cfg.device == "auto" else target_cfg
    draft_cfg = dataclasses.replace(draft_cfg, device=device) if draft_cfg.device == "auto" else draft_cfg
    if draft_cfg.kind == "head":  # built on the target (resispec/training/head_step.py)
        target, tok, draft = load_model(target_cfg, world), load_tokenizer(target_cfg, world), None
    else:
        target, draft, tok = load_pair(target_cfg, draft_cfg, world)
        draft.to(accelerator.device)
    target.to(accelerator.device).eval().requires_grad_(False)
    if rows is None:
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
    if draft is None:  # a head: built once the training rows exist (a reduced vocabulary counts their tokens)
        draft = build_head(target, draft_cfg, rows[0]).to(accelerator.device)
    return target, draft, tok, rows[0], rows[1]


def _to_rows(ds) -> list[tuple[list[int], list[int]]]:
    return [(list(r["prompt_ids"]), list(r["response_ids"])) for r in ds]


def _broadcast_str(accelerator, value: str) -> str:
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]
