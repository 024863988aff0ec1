"""Per-device memory plan of a distillation run, before anyone rents GPUs.

`plan_memory(...)` builds the target and the draft on the meta device from their `config.json` (no weights are
read; a local folder holding only config.json works), reads the sharding from an accelerate config
(recipes/accelerate/*.yaml), and returns the bytes one device holds:

| component | bytes per device |
|---|---|
| target weights | N_target x dtype bytes, never sharded (frozen, not wrapped); 0 with train.target_signal=cached |
| draft weights | full training: N_draft x 4 (float32 master weights, what the loop trains); LoRA: the frozen base in its dtype + the adapter in float32. / P when parameters are sharded (FSDP FULL_SHARD, ZeRO-3) |
| gradients | trainable x 4; / P when gradients are sharded (FSDP, ZeRO-2/3) |
| optimizer | AdamW: trainable x 8 (two float32 moments); / P when sharded (FSDP, ZeRO-1/2/3); 0 when offloaded |
| cached top-K | one batch of the cached signal: B x T x K x (4 + 8) (float32 log-probs, int64 ids, as the loss reads them) |
| activations | per process (train.batch_size rows of data.seq_len tokens, not divided by P): the draft's saved activations, B x T x (6h + 2 kv + 4 I) per layer in the compute dtype (SDPA attention: no T x T scores), plus its final hidden states; with an online target, one layer's transient activations |
| loss | the chunked loss (resispec.losses.distill_loss_rows) over N = B x min(data.regen.max_new_tokens, T - 1) response positions: the draft's hidden rows and their gradient [N, h] float32, the online target's rows [N, h_t], the LM head's gradient accumulator [V, h] float32 (full training), and one chunk's working set, LOSS_CHUNK_COPIES float32 [loss.chunk_size, V]; under FSDP or DeepSpeed the draft computes its rows' logits inside its forward: [N, V] in the compute dtype, a float32 copy and its float32 gradient instead of the head's accumulator |

These are estimates of the steady state: allocator fragmentation, the CUDA context (~0.5-1 GiB), FSDP's
unsharded layer during compute and communication buffers come on top. The parameter counts are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from resispec.errors import UserError

GIB = 2**30
# float32 [chunk, V] tensors alive at the peak of one chunk of the loss (logits of both sides, their log-probs,
# exp, the KL's products, the logits' gradient, ...): measured on fkl with resispec.analysis.loss_memory
LOSS_CHUNK_COPIES = 8.5
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "auto": 2}


@dataclass(frozen=True)
class Sharding:
    """What the accelerate config shards across its `num_processes` devices."""

    label: str
    num_processes: int = 1
    params: bool = False
    grads: bool = False
    optimizer: bool = False
    offload_params: bool = False
    offload_optimizer: bool = False
    mixed_precision: str = "no"


def sharding_from_accelerate_config(path: str | Path | None) -> Sharding:
    """Read an accelerate config file (None = one device, no sharding) with accelerate's own parser."""
    if path is None:
        return Sharding("single device")
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    kind = str(getattr(cfg.distributed_type, "value", cfg.distributed_type))
    n, mp = (
        int(cfg.num_processes or 1),
        str(getattr(cfg.mixed_precision, "value", cfg.mixed_precision) or "no"),
    )
    if kind == "FSDP":
        fsdp = cfg.fsdp_config or {}
        strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
        full = strategy in ("FULL_SHARD", "HYBRID_SHARD", "1", "4")
        some = strategy not in ("NO_SHARD", "3")
        off = bool(fsdp.get("fsdp_offload_params", False))
        return Sharding(f"FSDP {strategy} x{n}", n, full, some, some, off, off, mp)
    if kind == "DEEPSPEED":
        ds = cfg.deepspeed_config or {}
        stage = int(ds.get("zero_stage", 0))
        off_opt = str(ds.get("offload_optimizer_device", "none")) != "none"
        off_par = str(ds.get("offload_param_device", "none")) != "none"
        return Sharding(
            f"DeepSpeed ZeRO-{stage} x{n}", n, stage >= 3, stage >= 2, stage >= 1, off_par, off_opt, mp
        )
    if n > 1:
        return Sharding(f"DDP x{n} (replicated)", n, mixed_precision=mp)
    return Sharding("single device", 1, mixed_precision=mp)


@dataclass(frozen=True)
class ModelShape:
    """Exact parameter counts and the shapes activations depend on, from config.json on the meta device."""

    params: int
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int
    vocab: int
    lora_params: int = 0  # adapter parameters (0 without LoRA)


def model_shape(
    path: str, lora_r: int = 0, lora_targets: tuple[str, ...] = (), trust_remote_code: bool = False
):
    """Build the model on the meta device from `path` (a folder with config.json, a config.json file, or a hub
    name whose config is cached or reachable): no weights are loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    lora = 0
    if lora_r:
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in lora_targets:
                lora += lora_r * (mod.in_features + mod.out_features)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return ModelShape(
        params,
        text.hidden_size,
        text.num_hidden_layers,
        text.intermediate_size,
        kv_heads * head_dim,
        text.vocab_size,
        lora,
    )


@dataclass
class MemoryPlan:
    sharding: Sharding
    rows: list[tuple[str, int, str]] = field(default_factory=list)  # (component, bytes per device, note)

    @property
    def total(self) -> int:
        return sum(b for _, b, _ in self.rows)

    def row(self, name: str) -> int:
        return next(b for n, b, _ in self.rows if n == name)

    def format(self) -> str:
        lines = [
            f"Per-device memory plan ({self.sharding.label}, mixed precision {self.sharding.mixed_precision})",
            "",
            "| component | GiB per device | note |",
            "|---|---:|---|",
        ]
        lines += [f"| {n} | {b / GIB:.2f} | {note} |" for n, b, note in self.rows]
        lines.append(
            f"| **total** | **{self.total / GIB:.2f}** | estimate; add allocator and CUDA context overhead |"
        )
        return "\n".join(lines)


def plan_memory(
    target: ModelShape,
    draft: ModelShape,
    sharding: Sharding,
    *,
    target_dtype: str,
    draft_dtype: str,
    lora: bool,
    batch_size: int,
    seq_len: int,
    target_signal: str,
    cached_top_k: int,
    response_len: int | None = None,
    chunk_size: int = 256,
) -> MemoryPlan:
    """The per-device bytes of one training step (see the module docstring for each row)."""
    p = max(1, sharding.num_processes)
    bt, bd = DTYPE_BYTES[target_dtype], DTYPE_BYTES[draft_dtype]
    act = 2 if sharding.mixed_precision in ("bf16", "fp16") else 4
    split = lambda n, on: -(-n // p) if on else n  # noqa: E731  (ceil division)
    trainable = draft.lora_params if lora else draft.params
    weights = (draft.params * bd + draft.lora_params * 4) if lora else draft.params * 4
    b, t = batch_size, seq_len
    online = target_signal == "online"
    sharded = lambda on: f" / {p} (sharded)" if on and p > 1 else ""  # noqa: E731
    per_layer = b * t * (6 * draft.hidden + 2 * draft.kv_dim + 4 * draft.intermediate) * act
    draft_act = draft.layers * per_layer + b * t * draft.hidden * (act + 4)
    target_act = b * t * (4 * target.hidden + 3 * target.intermediate) * bt
    n_rows = b * min(response_len or t, t - 1)  # response positions: the loss's rows
    chunk = min(chunk_size or n_rows, n_rows)
    head_grad = 0 if lora else draft.vocab * draft.hidden * 4
    loss_bytes = n_rows * draft.hidden * 8 + head_grad + int(LOSS_CHUNK_COPIES * chunk * draft.vocab * 4)
    loss_bytes += n_rows * target.hidden * bt if online else 0
    if sharding.label.startswith(("FSDP", "DeepSpeed")):  # the draft computes its rows' logits in its forward
        loss_bytes += n_rows * draft.vocab * (act + 4 + 4) - head_grad  # logits, float32 copy, their gradient

    target_note = f"{target.params / 1e9:.2f}B params in {target_dtype}, replicated (frozen, not wrapped)"
    draft_note = f"{draft.params / 1e9:.3f}B params" + (" (LoRA base frozen)" if lora else ", float32 master")
    draft_note += sharded(sharding.params) + (" offloaded" if sharding.offload_params else "")
    optim_note = "AdamW, 2 float32 moments" + sharded(sharding.optimizer)
    optim_note += " offloaded to CPU" if sharding.offload_optimizer else ""
    act_note = f"batch {b} x seq {t} per process; draft {draft.layers} layers"
    loss_note = f"{n_rows} response positions in chunks of {chunk} x V={draft.vocab}"
    plan = MemoryPlan(sharding)
    plan.rows = [
        (
            "target weights",
            target.params * bt if online else 0,
            target_note if online else "cached top-K: the target is not in training memory",
        ),
        ("draft weights", 0 if sharding.offload_params else split(weights, sharding.params), draft_note),
        (
            "gradients",
            0 if sharding.offload_params else split(trainable * 4, sharding.grads),
            f"{trainable / 1e6:.1f}M trainable x 4 B" + sharded(sharding.grads),
        ),
        (
            "optimizer state",
            0 if sharding.offload_optimizer else split(trainable * 8, sharding.optimizer),
            optim_note,
        ),
        (
            "cached top-K batch",
            0 if online else b * t * cached_top_k * 12,
            "online target: none" if online else f"K={cached_top_k}",
        ),
        (
            "activations",
            draft_act + (target_act if online else 0),
            act_note + ("; target's layer transient" if online else ""),
        ),
        ("loss", loss_bytes, loss_note),
    ]
    return plan


def shape_of(model: torch.nn.Module, lora: bool = False) -> ModelShape:
    """The ModelShape of a loaded (or meta) model: the plan of the models a run holds."""
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) if lora else 0
    return ModelShape(
        params, text.hidden_size, text.num_hidden_layers, text.intermediate_size, kv_heads * head_dim,
        text.vocab_size, adapter,
    )  # fmt: skip


class MemoryPlanError(UserError, ValueError):
    """The planned per-device memory exceeds the device's (distillation refuses to start unless forced)."""


def check_fits(plan: MemoryPlan, device: torch.device, force: bool = False) -> None:
    """On a CUDA device, refuse (MemoryPlanError, one line) a plan over the device's total memory, unless
    `force` (train.force_memory=true). Other devices: nothing to check against."""
    if device.type != "cuda" or force:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if plan.total > total:
        raise MemoryPlanError(
            f"the memory plan needs {plan.total / GIB:.1f} GiB per device, this GPU has {total / GIB:.1f} GiB "
            f"({plan.sharding.label}); lower train.batch_size or data.seq_len, shard with FSDP "
            "(recipes/accelerate/fsdp.yaml), or set train.force_memory=true to try anyway"
        )


def sharding_of(accelerator) -> Sharding:
    """The Sharding of a live accelerate run (what `sharding_from_accelerate_config` reads from its file)."""
    kind, n = accelerator.distributed_type.value, accelerator.num_processes
    mp = str(getattr(accelerator.mixed_precision, "value", accelerator.mixed_precision) or "no")
    if kind == "FSDP":
        strategy = str(getattr(accelerator.state.fsdp_plugin, "sharding_strategy", "FULL_SHARD"))
        full = "FULL" in strategy or "HYBRID" in strategy
        some = "NO_SHARD" not in strategy
        return Sharding(f"FSDP x{n}", n, full, some, some, mixed_precision=mp)
    if kind == "DEEPSPEED":
        stage = int(getattr(accelerator.state.deepspeed_plugin, "zero_stage", 0) or 0)
        return Sharding(
            f"DeepSpeed ZeRO-{stage} x{n}", n, stage >= 3, stage >= 2, stage >= 1, mixed_precision=mp
        )
    return Sharding(f"DDP x{n} (replicated)" if n > 1 else "single device", n, mixed_precision=mp)


def run_plan(job, accelerator, target: torch.nn.Module, draft: torch.nn.Module) -> MemoryPlan:
    """The plan of a distillation job with its loaded models (before the draft's float32 master copy)."""
    lora = job.draft.adapter == "lora"
    name = lambda m: str(next(m.parameters()).dtype).removeprefix("torch.")  # noqa: E731
    return plan_memory(
        shape_of(target),
        shape_of(draft, lora),
        sharding_of(accelerator),
        target_dtype=name(target),
        draft_dtype=name(draft),
        lora=lora,
        batch_size=job.train.batch_size,
        seq_len=job.data.seq_len,
        target_signal=job.train.target_signal,
        cached_top_k=job.train.cached_top_k,
        response_len=job.data.regen.max_new_tokens,
        chunk_size=job.loss.chunk_size,
    )
