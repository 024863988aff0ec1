"""Tokenized (prompt, response) pairs -> fixed-length training rows with a loss mask on response tokens only."""

from __future__ import annotations

import datasets
import torch


def pack_example(prompt_ids: list[int], response_ids: list[int], seq_len: int, pad_id: int) -> dict:
    """One row of `seq_len` tokens: prompt (its last seq_len // 2 tokens at most), then as much response as fits,
    then right padding. loss_mask[t] = 1 iff input_ids[t] is a response token (a label predicted from t - 1)."""
    prompt = list(prompt_ids)[-(seq_len // 2) :] if len(prompt_ids) > seq_len // 2 else list(prompt_ids)
    response = list(response_ids)[: seq_len - len(prompt)]
    ids = prompt + response
    pad = seq_len - len(ids)
    return {
        "input_ids": ids + [pad_id] * pad,
        "attention_mask": [1] * len(ids) + [0] * pad,
        "loss_mask": [0] * len(prompt) + [1] * len(response) + [0] * pad,
    }


def pack(dataset: datasets.Dataset, seq_len: int, pad_id: int) -> datasets.Dataset:
    """Dataset(prompt_ids, response_ids) -> Dataset(input_ids, attention_mask, loss_mask), one pair per row.

    One pair per row (not several concatenated) keeps plain causal attention exact: no pair sees another.
    Rows whose response is empty are dropped (they carry no loss)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    rows = dataset.filter(lambda r: len(r["response_ids"]) > 0)
    return rows.map(
        lambda r: pack_example(r["prompt_ids"], r["response_ids"], seq_len, pad_id),
        remove_columns=rows.column_names,
    )


def trim_padding(batch: dict) -> dict:
    """A batch of right-padded rows [B, seq_len, ...] cut to its longest row (attention_mask's last 1): the
    columns after it are padding in every row, and with right padding no kept position attends to them, so the
    forward and the loss are the same on fewer positions. Every tensor of the batch is cut along dim 1."""
    mask = batch["attention_mask"]
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    length = max(int((mask.bool() * cols).max()), 1)
    if length == mask.shape[1]:
        return batch
    return {k: v[:, :length] if getattr(v, "dim", lambda: 0)() >= 2 else v for k, v in batch.items()}
