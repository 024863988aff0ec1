"""How the distillation loop gets its `Accelerator`: the launch that was asked for, or a clear error.

accelerate decides single-process / DDP / FSDP / DeepSpeed from the environment `accelerate launch` sets. Two of
its silent fallbacks are refused or repaired here, so that a user who asked for sharding gets sharding:

- `accelerate launch --cpu --num_processes 2 ...` starts ONE process (accelerate sends `--cpu` runs to its
  simple launcher; several CPU processes need mpirun). That launch leaves MASTER_ADDR set and no WORLD_SIZE:
  `LaunchError`.
- FSDP asked for (ACCELERATE_USE_FSDP) on CPU processes: accelerate 1.x runs them as plain DDP (MULTI_CPU) and
  never shards. Here FSDP is switched on explicitly over gloo, with module-state sync off (FSDP refuses it on
  CPU; every process loads the full draft from disk anyway), and the log says so.
- FSDP / DeepSpeed asked for but the accelerator ended up without it: `LaunchError`.

RAM-efficient loading (`fsdp_cpu_ram_efficient_loading`) is always turned off: it gives non-zero ranks empty
weights that only FSDP's module sync fills, and the frozen target is never wrapped by FSDP.
"""

from __future__ import annotations

import os

import torch

from resispec.errors import UserError


class LaunchError(UserError, RuntimeError):
    """The processes were not started the way the launch command asked (a silent fallback accelerate made)."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def make_accelerator(
    cpu: bool,
    mixed_precision: str,
    grad_accum: int,
    batch_size: int = 1,
    grad_clip: float = 0.0,
    timeout_minutes: float | None = None,
):
    """An `Accelerator` for this launch (see the module docstring). Prints what it changed on the main process.

    batch_size / grad_clip: DeepSpeed's micro-batch and clipping (`deepspeed_batch_settings`); timeout_minutes:
    the process group's collective timeout (None: torch's default, 10 min for NCCL), long enough for the slowest
    rank's share of regeneration or of the cached target build while the others wait."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    fsdp, deepspeed = _flag("ACCELERATE_USE_FSDP"), _flag("ACCELERATE_USE_DEEPSPEED")
    notes = []
    if fsdp and _flag("FSDP_CPU_RAM_EFFICIENT_LOADING"):
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"  # read by transformers' from_pretrained
        notes.append(
            "fsdp_cpu_ram_efficient_loading off: every process loads real weights (the target is unwrapped)"
        )
    if fsdp and cpu and _flag("FSDP_SYNC_MODULE_STATES"):
        os.environ["FSDP_SYNC_MODULE_STATES"] = "false"
        notes.append(
            "fsdp_sync_module_states off: FSDP refuses it on CPU (every process loaded the same weights)"
        )
    handlers = (
        []
        if timeout_minutes is None
        else [InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes))]
    )
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=grad_accum,
        kwargs_handlers=handlers,
    )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        notes += deepspeed_batch_settings(
            accelerator.state.deepspeed_plugin.deepspeed_config,
            batch_size,
            grad_accum,
            accelerator.num_processes,
            grad_clip,
        )
    if fsdp and accelerator.distributed_type == DistributedType.MULTI_CPU:
        _enable_cpu_fsdp(accelerator)
        notes.append(
            f"FSDP over gloo on {accelerator.num_processes} CPU processes (accelerate alone would run DDP)"
        )
    for note in notes:
        accelerator.print(f"[distributed] {note}")
    check_launch(accelerator, fsdp=fsdp, deepspeed=deepspeed)
    return accelerator


def deepspeed_batch_settings(
    config: dict, batch_size: int, grad_accum: int, num_processes: int, grad_clip: float
) -> list[str]:
    """Fill a DeepSpeed config (the plugin's `deepspeed_config`, in place) from the run's settings: the loop
    prepares no dataloader, so accelerate cannot resolve `train_micro_batch_size_per_gpu: auto` and `prepare`
    refuses. Micro-batch = train.batch_size, accumulation = train.grad_accum, the global batch their product over
    the processes, clipping = optim.grad_clip (DeepSpeed clips inside its engine). Returns what it changed."""
    want = {
        "train_micro_batch_size_per_gpu": int(batch_size),
        "gradient_accumulation_steps": int(grad_accum),
        "train_batch_size": int(batch_size) * int(grad_accum) * int(num_processes),
        "gradient_clipping": float(grad_clip),
    }
    notes = []
    for key, value in want.items():
        if config.get(key) != value:
            if config.get(key) not in (None, "auto"):
                notes.append(f"DeepSpeed {key} {config[key]} -> {value} (from the run's config)")
            config[key] = value
    return notes


def _enable_cpu_fsdp(accelerator) -> None:
    """Turn a MULTI_CPU accelerator into an FSDP one: the plugin from the launch environment, the plain `cpu`
    device (FSDP compares it with the parameters' device, and accelerate's `cpu:0` never matches)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin()
    state.distributed_type = DistributedType.FSDP
    state.device = torch.device("cpu")
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    PartialState._shared_state["device"] = torch.device("cpu")


def check_launch(accelerator, fsdp: bool, deepspeed: bool) -> None:
    """Raise `LaunchError` when the processes are not what the launch command asked for."""
    from accelerate.utils import DistributedType

    env = os.environ
    single_fallback = (
        accelerator.num_processes == 1
        and "ACCELERATE_USE_CPU" in env  # started by `accelerate launch`
        and "MASTER_ADDR" in env  # ... which sets it only when asked for several processes
        and not any(k in env for k in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
    )
    if single_fallback:
        raise LaunchError(
            "accelerate launch was asked for several processes but started ONE: with --cpu it uses its "
            "single-process launcher (several CPU processes need mpirun). For FSDP on CPU use "
            "`accelerate launch --config_file recipes/accelerate/fsdp_cpu.yaml ...` without --cpu; for DDP on CPU "
            "use `torchrun --nproc_per_node N ...`"
        )
    if fsdp and accelerator.distributed_type != DistributedType.FSDP:
        raise LaunchError(
            f"the accelerate config asks for FSDP but the run is {accelerator.distributed_type.value} with "
            f"{accelerator.num_processes} process(es): refusing to train unsharded"
        )
    if deepspeed and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise LaunchError(
            f"the accelerate config asks for DeepSpeed but the run is {accelerator.distributed_type.value}: "
            "DeepSpeed needs GPUs here (see recipes/accelerate/README.md)"
        )


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def full_state_dict(accelerator, model) -> dict:
    """The unsharded state dict of a prepared model (FSDP / ZeRO-3 shards gathered). On CPU FSDP it is gathered
    onto every process: torch's rank-0 CPU-offload path (what accelerate uses) crashes on CPU tensors."""
    if is_fsdp(accelerator) and accelerator.device.type == "cpu":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()
    return accelerator.get_state_dict(model)


def local_param_numel(model) -> int:
    """Parameter elements this process holds: its shard under FSDP (orig params are views into the local flat
    shard), the whole model otherwise."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


@torch.no_grad()
def materialize_optimizer_state(optimizer) -> None:
    """Give every parameter its optimizer state (a step with zero gradients at lr 0: no parameter moves) before
    an FSDP resume. accelerate loads a sharded optimizer checkpoint into the keys of the live optimizer's state
    dict; a fresh optimizer has none, so the Adam moments would silently stay empty (measured here: the resumed
    loss curve drifted by 1e-3 relative from the second resumed step on)."""
    inner = getattr(
        optimizer, "optimizer", optimizer
    )  # accelerate's AcceleratedOptimizer wraps the torch one
    lrs = [group["lr"] for group in inner.param_groups]
    for group in inner.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    inner.step()
    inner.zero_grad(set_to_none=True)
    for group, lr in zip(inner.param_groups, lrs, strict=True):
        group["lr"] = lr
