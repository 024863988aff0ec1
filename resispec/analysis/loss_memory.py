"""Peak CPU memory of one distillation loss step at a real vocabulary, above the models' own.

    python bench/loss_memory.py [--vocab 128256] [--positions 4096] [--rows 4] [--loss fkl] [--json]

Builds a one-layer Llama draft and target of the given vocabulary (random weights, tiny hidden size, so the models
themselves are small and the loss's [N, V] tensors dominate), a batch of `rows` rows whose response positions
total `positions`, and runs the loop's own micro-batch loss (`resispec.training.loop.micro_batch_loss`) plus the
backward once to warm up, then measures a second step: the peak resident memory during the step minus the resident
memory just before it (Linux VmHWM after resetting it through /proc/self/clear_refs), and the step's wall time.
Each measurement runs in a fresh subprocess so nothing of a previous variant stays resident. The same command
measures whatever the loop does today, so before / after a change are compared with one command.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from resispec.decoding.config import DecodeConfig
from resispec.losses import LossConfig
from resispec.models.config import ModelConfig
from resispec.training import loop
from resispec.training.config import TrainConfig
from resispec.training.measure import status_kib


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set size (VmHWM) to now
        f.write("5")


def build(vocab: int, positions: int, rows: int, prompt: int = 32, hidden: int = 64, seed: int = 0):
    """(draft, target, batch, mask): micro Llamas of `vocab` tokens and a batch with `positions` response
    positions over `rows` rows (each row: `prompt` prompt tokens then its share of the responses)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)

    def model(h: int):
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=h,
            intermediate_size=2 * h,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=prompt + positions + 8,
            tie_word_embeddings=False,
        )
        return LlamaForCausalLM(cfg).float()

    draft, target = model(hidden), model(hidden + 32)
    target.eval().requires_grad_(False)
    per_row = -(-positions // rows)
    seq = prompt + per_row + 1  # the last position predicts past the row and is dropped
    ids = torch.randint(0, vocab, (rows, seq))
    loss_mask = torch.zeros(rows, seq, dtype=torch.long)
    left = positions
    for r in range(rows):
        n = min(per_row, left)
        loss_mask[r, prompt + 1 : prompt + 1 + n] = 1  # token t is a response token: predicted from t - 1
        left -= n
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    return draft, target, batch, loss_mask[:, 1:]


def measure(vocab: int, positions: int, rows: int, loss_name: str, chunk: int | None) -> dict:
    """One variant in this process: {peak_mib, step_s, ...}."""
    import torch
    from accelerate import Accelerator

    torch.set_num_threads(1)
    draft, target, batch, mask = build(vocab, positions, rows)
    acc = Accelerator(cpu=True)
    draft = acc.prepare(draft)
    loss_cfg = LossConfig(name=loss_name)
    if chunk is not None and hasattr(loss_cfg, "chunk_size"):
        loss_cfg.chunk_size = chunk
    job = SimpleNamespace(loss=loss_cfg, decode=DecodeConfig(), train=TrainConfig(target_signal="online"))
    job.draft = ModelConfig()  # a standalone draft model, as the loop reads it
    run = SimpleNamespace(job=job, draft=draft, target=target, accelerator=acc)

    def step() -> float:
        t0 = time.perf_counter()
        value, _ = loop.micro_batch_loss(run, batch, mask)
        value.backward()
        draft.zero_grad(set_to_none=False)  # keep the gradient buffers: they are the models' own memory
        return time.perf_counter() - t0

    step()  # warm-up: allocates the parameter gradients
    base = status_kib("VmRSS")
    _reset_peak()
    seconds = min(step() for _ in range(1))
    peak = status_kib("VmHWM")
    return {
        "vocab": vocab,
        "positions": positions,
        "rows": rows,
        "loss": loss_name,
        "chunk": chunk,
        "peak_above_models_mib": round((peak - base) / 1024, 1),
        "base_mib": round(base / 1024, 1),
        "step_s": round(seconds, 3),
    }
