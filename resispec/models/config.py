"""Typed config for model loading and the embedded tiny world (Hydra groups `target`, `draft`, `world`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class HeadConfig:
    """An EAGLE-3-style draft head (draft.kind=head; resispec/models/head.py): built on the target at the start of
    training, or loaded from `path` (a head folder) for decoding."""

    layers: list[int] | None = (
        None  # target layer ids whose input states are fused; None = EAGLE-3's (2, L//2, L-3)
    )
    draft_vocab_size: int | None = (
        None  # reduced draft vocabulary (most frequent training tokens); None = target's
    )
    intermediate_size: int | None = None  # the head layer's MLP width; None = the target's
    ttt_steps: int = (
        3  # training-time test: unrolled steps, the head feeding on its own states after the first
    )
    step_decay: float = 0.8  # loss weight of unrolled step j: step_decay ** j (EAGLE-3's 0.8)
    # the pipeline (train/pipeline.py) also trains a head beside the standalone draft (same data, loss, optim and
    # train sections), benches both and exports both: +recipe=tiny_head
    beside: bool = False
    # the head's train.max_steps when it trains beside a draft; None = the draft's. A head starts from scratch
    # where a standalone draft starts pre-trained (docs/draft_heads.md: the tiny head gains up to 600 steps)
    max_steps: int | None = None


@dataclass
class ModelConfig:
    """A causal LM to load. `path` is a hub name, a local folder, or `world:target` / `world:draft`
    (the embedded tiny world's checkpoints, built on first use)."""

    path: str = "world:target"
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None  # None = transformers' default (sdpa)
    adapter: str = "none"  # none | lora (drafts only: train a LoRA adapter instead of all weights)
    lora: LoraConfig = field(default_factory=LoraConfig)
    kind: str = "model"  # drafts: model (a standalone causal LM) | head (a draft head on the target's states)
    head: HeadConfig = field(default_factory=HeadConfig)


@dataclass
class SizeConfig:
    """A Llama-architecture size preset for the tiny world."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 1024


@dataclass
class PretrainConfig:
    """How long and how to train one model of the tiny world."""

    max_steps: int = 600
    max_minutes: float = 6.0
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    # auto: bf16 autocast where the hardware multiplies bf16 natively (CUDA with bf16, CPUs with AVX512-BF16 or
    # AMX, measured 1.9x the float32 step on this machine's EPYC), float32 elsewhere | bf16 | no (float32)
    mixed_precision: str = "auto"


@dataclass
class WorldConfig:
    """The embedded default world: stdlib text, a local BPE tokenizer, a small target and a smaller draft."""

    name: str = "tiny"
    cache_dir: str | None = None  # default: $RESISPEC_CACHE or ~/.cache/resispec
    vocab_size: int = 8192
    max_position_embeddings: int = 1024
    max_files: int | None = None  # limit the stdlib files read (micro world)
    seed: int = 0
    num_threads: int | None = None  # torch threads while building; None = torch's default (all cores)
    target: SizeConfig = field(default_factory=SizeConfig)
    draft: SizeConfig = field(
        default_factory=lambda: SizeConfig(
            hidden_size=96, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=384
        )
    )
    # Target: trained at `target` size, then (grow_factor > 1) deepened by block expansion: every trained layer is
    # followed by grow_factor - 1 copies whose output projections start at zero, so the deeper model computes the
    # same function and costs grow_factor x per token; `target_grow_train` then trains all layers briefly.
    grow_factor: int = 3
    target_train: PretrainConfig = field(
        default_factory=lambda: PretrainConfig(max_steps=560, max_minutes=60.0)
    )
    target_grow_train: PretrainConfig = field(
        default_factory=lambda: PretrainConfig(max_steps=20, max_minutes=20.0, lr=1e-3, warmup_steps=10)
    )
    draft_train: PretrainConfig = field(
        default_factory=lambda: PretrainConfig(max_steps=200, max_minutes=15.0, warmup_steps=20)
    )
