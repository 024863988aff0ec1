"""Batched autoregressive decoding: many rows (resispec/decoding/batch_rows.py), ONE target forward per step.

  step()  one target forward over every row's pending token; each row samples its own next token with THE
          sampling transform (resispec.sampling) and its own generator, checks its own stops; finished rows leave.

Cache layout (resispec.decoding.kv_cache, "batched caches"): one DynamicCache of T columns; rows are right-aligned
(row b owns the last lengths[b] columns, the padding before them is hidden by a 4D additive mask) and position ids
are per row, so a row sees exactly what it would see alone. When rows leave, the padding every remaining row shares is
dropped, so T is always the longest running row's length: memory is bounded by rows x longest row.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from resispec.decoding.batch_rows import BatchRow, RowBatch
from resispec.decoding.kv_cache import (
    batch_attention_mask,
    forward_logits,
    merge_cache_row,
    new_cache,
    select_cache_rows,
    trim_cache_left,
)


class BatchedDecoder(RowBatch):
    """Batched autoregressive decoding of `target` (an HF causal LM, sdpa or eager attention).

    vocab_size: logits are cut to this size before sampling (the pair's shared vocabulary; default the target's).
    tokenizer: needed only for stop strings. `from_decoder(dec)` shares a SpeculativeDecoder's target and settings.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        tokenizer=None,
        vocab_size: int | None = None,
        forward: Callable | None = None,
    ) -> None:
        vocab_size = vocab_size or target.get_output_embeddings().weight.shape[0]
        super().__init__(target, tokenizer, vocab_size, forward)
        self.cache = new_cache(target)
        self.num_cols = 0  # T: columns of the batch cache

    @classmethod
    def from_decoder(cls, decoder) -> BatchedDecoder:
        """The batched AR path of a `SpeculativeDecoder` (same target, vocabulary cut and compiled forward)."""
        return cls(decoder.target, decoder.tokenizer, decoder.vocab_size, decoder.target_forward)

    def _join(self, rows: list[BatchRow]) -> None:
        """Prefill the new rows together and merge them into the batch cache."""
        caches = self._prefill_rows(rows)["target"]
        for row, row_cache in zip(rows, caches, strict=True):
            merge_cache_row(self.cache, len(self.rows), row_cache)
            self.num_cols = max(self.num_cols, row.length)
            self.rows.append(row)

    def _target_cache(self):
        return self.cache

    def _row_columns(self, b: int, row: BatchRow) -> torch.Tensor:
        # row b owns the last row.length of the num_cols columns
        return torch.arange(self.num_cols - row.length, self.num_cols, device=self.device)

    def _keep_cache_rows(self, sel: torch.Tensor) -> None:
        select_cache_rows(self.cache, sel)
        longest = max((r.length for r in self.rows), default=0)
        trim_cache_left(self.cache, self.num_cols - longest)  # padding no remaining row needs
        self.num_cols = longest
        if not self.rows:
            self.cache = new_cache(self.target)

    def reset(self) -> None:
        """Drop every row (after a failed step)."""
        self.rows, self.cache, self.num_cols = [], new_cache(self.target), 0

    @property
    def kv_tokens(self) -> int:
        """Cache slots held now: rows x columns (padding included)."""
        return len(self.rows) * self.num_cols

    @torch.inference_mode()
    def step(self) -> list[tuple[BatchRow, list[int]]]:
        """One target forward for all rows -> [(row, [its new token])] for every row that was running; rows that
        finished (row.finished) have left the batch."""
        rows = self.rows
        if not rows:
            return []
        t0 = time.perf_counter()
        lengths = torch.tensor([r.length for r in rows], device=self.device)  # [B]
        ids = torch.tensor([[r.root] for r in rows], device=self.device)  # [B, 1]
        mask = (
            None  # no padding (every row spans all T columns): the plain causal path, as the batch-1 decoder
        )
        if any(r.length != self.num_cols for r in rows):
            mask = batch_attention_mask(lengths, self.num_cols, 1, self._t_dtype)  # [B, 1, 1, T + 1]
        logits = forward_logits(self._target_fwd, ids, self.cache, lengths[:, None], mask)
        self.num_cols += 1
        out = self._emit_ar(rows, logits[:, -1, : self.vocab_size], t0)
        self._keep([r for r in rows if not r.finished])
        return out
