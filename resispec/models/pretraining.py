"""Pretraining and measuring the tiny world's models: a causal-LM loop over a token stream, held-out loss,
a unigram baseline, per-token forward time with a KV cache, and generated samples."""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from resispec.models.config import PretrainConfig


def lr_factor(step: int, progress: float, warmup_steps: int, floor: float = 0.1) -> float:
    """Linear warmup, then cosine decay to `floor` over progress in [0, 1].

    Progress is max(step / max_steps, elapsed / max_minutes), so a run cut short by the time budget still
    ends its schedule at the low learning rate instead of mid-way."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return warm * (floor + (1.0 - floor) * cos)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only (not norms, not the tied embedding), as usual for LMs."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def resolve_mixed_precision(mode: str, device: torch.device | str = "cpu") -> str:
    """'auto' -> 'bf16' where bf16 matmuls are native (CUDA with bf16 support; a CPU whose oneDNN does bf16,
    i.e. AVX512-BF16 or AMX), else 'no'. 'bf16' and 'no' pass through; anything else is an error."""
    if mode not in ("auto", "bf16", "no"):
        raise ValueError(f"mixed_precision must be auto, bf16 or no, got {mode!r}")
    if mode != "auto":
        return mode
    if torch.device(device).type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    try:
        return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no"
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return "no"


def autocast(mode: str, device: torch.device | str = "cpu"):
    """The forward's autocast context for a resolved mode ('bf16' or 'no'); weights stay float32."""
    if mode == "no":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def sample_windows(
    stream: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator
) -> torch.Tensor:
    """Random windows of a token stream. -> [B, T] long."""
    starts = rng.integers(0, len(stream) - seq_len, size=batch_size)
    return torch.from_numpy(np.stack([stream[s : s + seq_len] for s in starts]).astype(np.int64))


def _optimizer_step(model, opt, input_ids: torch.Tensor, precision: str, device) -> torch.Tensor:
    """One causal-LM training step on `input_ids` [B, T] (forward under the precision, clipped gradients) -> loss."""
    with autocast(precision, device):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def train_lm(
    model: torch.nn.Module,
    train_ids: np.ndarray,  # [N] int32 token stream
    cfg: PretrainConfig,
    seed: int,
    desc: str = "train",
    progress: bool = True,
) -> dict:
    """Train a causal LM on random windows of `train_ids` until max_steps or max_minutes. Returns stats."""
    model.train()
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    seq_len = min(cfg.seq_len, len(train_ids) - 1)
    budget_s = cfg.max_minutes * 60.0
    start = time.perf_counter()
    device = next(model.parameters()).device
    precision = resolve_mixed_precision(cfg.mixed_precision, device)
    bar = tqdm(total=cfg.max_steps, desc=desc, disable=not progress, dynamic_ncols=True)
    step, ema = 0, None
    while step < cfg.max_steps:
        elapsed = time.perf_counter() - start
        done = max(step / cfg.max_steps, elapsed / budget_s if budget_s > 0 else 0.0)
        if done >= 1.0:
            break
        scale = lr_factor(step, done, cfg.warmup_steps)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * scale
        input_ids = sample_windows(train_ids, cfg.batch_size, seq_len, rng)  # [B, T]
        loss = _optimizer_step(model, opt, input_ids, precision, device)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{cfg.lr * scale:.1e}")
    bar.close()
    seconds = time.perf_counter() - start
    model.eval()
    tokens = step * cfg.batch_size * seq_len
    return {
        "steps": step,
        "train_seconds": round(seconds, 1),
        "train_tokens": tokens,
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        "final_train_loss_ema": round(float(ema), 4) if ema is not None else None,
        "stopped_by": "steps" if step >= cfg.max_steps else "time",
        "mixed_precision": precision,
    }


def step_seconds(model: torch.nn.Module, cfg: PretrainConfig, vocab_size: int, reps: int = 2) -> float:
    """Median seconds of a training step of `model` at `cfg`'s batch shape and precision, on random tokens, after
    one warm-up step: the probe behind the world build's time estimate. It updates the weights: pass a throwaway
    model."""
    device = next(model.parameters()).device
    precision = resolve_mixed_precision(cfg.mixed_precision, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(
        0, vocab_size, (cfg.batch_size, cfg.seq_len), generator=torch.Generator().manual_seed(0)
    )
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        _optimizer_step(model, opt, ids, precision, device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows spread evenly over a held-out stream (deterministic). -> [W, T] long."""
    seq_len = min(seq_len, len(stream))
    total = len(stream) // seq_len
    picks = np.linspace(0, total - 1, num=min(total, max_windows)).round().astype(int)
    picks = np.unique(picks)
    return torch.from_numpy(
        np.stack([stream[i * seq_len : (i + 1) * seq_len] for i in picks]).astype(np.int64)
    )


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over every predicted position of the windows [W, T]."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids = windows[i : i + batch_size]  # [b, T]
        logits = model(input_ids=ids).logits[:, :-1].float()  # [b, T-1, V]
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        total += nll.item()
        count += ids[:, 1:].numel()
    return total / count


def unigram_loss(train_ids: np.ndarray, windows: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of an add-one unigram model of the train stream on the same predicted positions."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    targets = windows[:, 1:].numpy().ravel()
    return float(-logp[targets].mean())


@torch.no_grad()
def forward_ms(
    model: torch.nn.Module, vocab_size: int, prefix_len: int = 256, reps: int = 30, seed: int = 0
) -> float:
    """Median ms of one forward pass for 1 new token, batch 1, with `prefix_len` tokens already in the KV cache."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    prefix_len = min(prefix_len, model.config.max_position_embeddings - reps - 8)
    ids = torch.randint(0, vocab_size, (1, prefix_len), generator=gen)  # [1, P]
    out = model(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    times = []
    for _ in range(reps + 3):
        nxt = torch.randint(0, vocab_size, (1, 1), generator=gen)  # [1, 1]
        t0 = time.perf_counter()
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache = getattr(out, "cache", None) or out.past_key_values
    return float(np.median(times[3:]) * 1e3)  # the first calls warm up allocator and kernels


@torch.no_grad()
def generate_samples(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int, seed: int
) -> list[dict]:
    """Sampled continuations (temperature 0.8) of a few prompts, decoded, for the log and the report."""
    torch.manual_seed(seed)
    samples = []
    for ids in prompts:
        input_ids = torch.tensor([ids])  # [1, P]
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=True,
            temperature=0.8,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )  # [1, P + new]
        samples.append(
            {
                "prompt": tokenizer.decode(ids, skip_special_tokens=True),
                "continuation": tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True),
            }
        )
    return samples
