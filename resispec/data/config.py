"""Typed config for prompts, target regeneration and packing (Hydra group `data`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RegenConfig:
    """Sampling settings for target regeneration (on-policy responses)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 16
    seed: int = 0
    engine: str = "hf"  # hf (built-in, HF generate) | vllm (vLLM's offline API from the isolated venv)


@dataclass
class DataConfig:
    """Where prompts come from. `source`: `stdlib` (the embedded world's text), a local `.jsonl` path with
    `prompt` or chat `messages` fields, or a Hugging Face dataset name."""

    source: str = "stdlib"
    split: str = "train"
    eval_split: str = "validation"
    # held-out prompts for the bench, load test and the server's plan (split `test`): never trained on, and not
    # the eval rows that pick the checkpoint when it names the same source split (those rows are skipped)
    test_split: str = "test"
    prompt_field: str = "prompt"
    # extra variables for the tokenizer's chat template wherever a chat prompt is rendered (prompt sets and the
    # server's chat endpoint), e.g. {enable_thinking: false} for Qwen3 (its template thinks unless told not to)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    messages_field: str = "messages"
    num_train_prompts: int = 512
    num_eval_prompts: int = 64
    prompt_tokens: int = 64  # stdlib prompts: tokens of code used as the prompt
    seq_len: int = 256  # packing length for training
    responses: str = "regenerate"  # regenerate (on-policy, cached) | fixed (the dataset's own text)
    # on-policy for the draft (GKD / DistillSpec): this fraction of the training prompts gets the initial draft's
    # own sampled responses instead of the target's (the target still scores every position); 0 = off
    draft_fraction: float = 0.0
    regen: RegenConfig = field(default_factory=RegenConfig)
    cache_dir: str | None = None  # default: under the world cache
