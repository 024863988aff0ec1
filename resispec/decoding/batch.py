"""Batched autoregressive decoding (DESIGN.md "Batched decoding and scheduling"): many rows, ONE target forward.

Rows have different prompt lengths, their own sampling settings (temperature, top-p, top-k), stop conditions,
max tokens and torch.Generator. They join and leave at step boundaries:

  add(prompt, ...)  prefill the new row alone (one batch-1 forward over prompt[:-1], as the batch-1 decoder does),
                    then merge its cache into the batch cache as a new row.
  step()            one target forward over every row's pending token; each row samples its own next token with
                    THE sampling transform (resispec.decoding.sampling) and its own generator, checks its own stops;
                    finished rows leave the batch.
  remove(row)       drop a row now (a cancelled request).

Cache layout (resispec.decoding.kv_cache, "batched caches"): one DynamicCache of T columns; rows are right-aligned
(row b owns the last lengths[b] columns, the padding before them is hidden by a 4D additive mask) and position ids
are per row, so a row sees exactly what it would see alone. When rows leave, the padding every remaining row shares is
dropped, so T is always the longest running row's length: memory is bounded by rows x longest row.

Exactness: a greedy row emits the target's greedy tokens (identical to decoding it alone and to HF generate, up to
floating-point differences between batch shapes); a sampled row draws from process_logits(target logits) with its
own generator, one multinomial draw per token, exactly as SpeculativeDecoder's AR path does, so a seeded row gives the
same tokens whatever its neighbours.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from resispec.decoding.kv_cache import (
    batch_attention_mask,
    forward_logits,
    merge_cache_row,
    new_cache,
    select_cache_rows,
    trim_cache_left,
)
from resispec.decoding.sampling import process_logits, sample_tokens
from resispec.decoding.stats import DecodeStats
from resispec.decoding.stopping import StopChecker, make_stop_string_checker, normalize_eos


@dataclass(eq=False)
class BatchRow:
    """One sequence of the batch. `generated` grows by one token per step; `finished` once a stop fired."""

    prompt: list[int]
    max_new_tokens: int
    settings: dict  # temperature, top_k, top_p
    eos: frozenset
    checkers: list[StopChecker]
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    stats: DecodeStats = field(default_factory=DecodeStats)
    root: int = 0  # the last committed token, not yet in the cache
    length: int = 0  # tokens of this row held in the cache
    started: float = field(default_factory=time.perf_counter)

    @property
    def greedy(self) -> bool:
        return self.settings["temperature"] <= 0.0

    def emit(self, tok: int) -> bool:
        """Record one token; True when it ends the row (EOS, stop checker, max tokens)."""
        self.generated.append(tok)
        self.stats.num_new_tokens += 1
        self.finished = (
            tok in self.eos
            or len(self.generated) >= self.max_new_tokens
            or any(c(self.generated) for c in self.checkers)
        )
        self.stats.total_seconds = time.perf_counter() - self.started
        return self.finished


class BatchedDecoder:
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
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or target.get_output_embeddings().weight.shape[0]
        self.device = next(target.parameters()).device
        self._fwd = forward if forward is not None else target
        self.rows: list[BatchRow] = []
        self.cache = new_cache(target)
        self.num_cols = 0  # T: columns of the batch cache

    @classmethod
    def from_decoder(cls, decoder) -> BatchedDecoder:
        """The batched AR path of a `SpeculativeDecoder` (same target, vocabulary cut and compiled forward)."""
        return cls(decoder.target, decoder.tokenizer, decoder.vocab_size, decoder._target_fwd)

    # ------------------------------------------------------------------ rows join and leave
    @torch.inference_mode()
    def add(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_token_id: int | Sequence[int] | None = None,
        stop: str | Sequence[str] | None = None,
        stop_checker: StopChecker | None = None,
        generator: torch.Generator | None = None,
    ) -> BatchRow:
        """Prefill a new row (one forward over prompt[:-1]) and add it to the batch. Settings as
        SpeculativeDecoder.generate_stream. A row with max_new_tokens <= 0 is returned finished, not added."""
        prompt = torch.as_tensor(prompt_ids).reshape(-1).tolist()
        if not prompt:
            raise ValueError("empty prompt")
        if eos_token_id is None:
            eos_token_id = getattr(getattr(self.target, "generation_config", None), "eos_token_id", None)
        checkers = [c for c in (stop_checker,) if c is not None]
        if stop:
            if self.tokenizer is None:
                raise ValueError("stop strings need BatchedDecoder(..., tokenizer=...) or a stop_checker")
            checkers.append(make_stop_string_checker(self.tokenizer, stop))
        row = BatchRow(
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            settings=dict(temperature=temperature, top_k=top_k, top_p=top_p),
            eos=normalize_eos(eos_token_id),
            checkers=checkers,
            generator=generator,
            root=prompt[-1],
            length=len(prompt) - 1,
        )
        if max_new_tokens <= 0:
            row.finished = True
            return row
        row_cache = new_cache(self.target)
        if len(prompt) > 1:
            t0 = time.perf_counter()
            ids = torch.tensor([prompt[:-1]], device=self.device)
            forward_logits(self._fwd, ids, row_cache, logits_to_keep=1)
            row.stats.target_seconds += time.perf_counter() - t0
            row.stats.target_forwards += 1
        merge_cache_row(self.cache, len(self.rows), row_cache)
        self.num_cols = max(self.num_cols, row.length)
        self.rows.append(row)
        return row

    def remove(self, row: BatchRow) -> None:
        """Drop `row` from the batch now (a cancelled request); a row not in the batch is ignored."""
        self._keep([r for r in self.rows if r is not row])

    def _keep(self, rows: list[BatchRow]) -> None:
        if len(rows) == len(self.rows):
            return
        index = {id(r): i for i, r in enumerate(self.rows)}
        select_cache_rows(
            self.cache, torch.tensor([index[id(r)] for r in rows], dtype=torch.long, device=self.device)
        )
        self.rows = rows
        longest = max((r.length for r in rows), default=0)
        trim_cache_left(self.cache, self.num_cols - longest)  # padding no remaining row needs
        self.num_cols = longest
        if not rows:
            self.cache = new_cache(self.target)

    def reset(self) -> None:
        """Drop every row (after a failed step)."""
        self.rows, self.cache, self.num_cols = [], new_cache(self.target), 0

    @property
    def kv_tokens(self) -> int:
        """Cache slots held now: rows x columns (padding included)."""
        return len(self.rows) * self.num_cols

    # ------------------------------------------------------------------ one step for every row
    @torch.inference_mode()
    def step(self) -> list[tuple[BatchRow, list[int]]]:
        """One target forward for all rows -> [(row, [its new token])] for every row that was running; rows that
        finished (row.finished) have left the batch."""
        rows = self.rows
        if not rows:
            return []
        t0 = time.perf_counter()
        dev = self.device
        lengths = torch.tensor([r.length for r in rows], device=dev)  # [B]
        ids = torch.tensor([[r.root] for r in rows], device=dev)  # [B, 1]
        mask = (
            None  # no padding (every row spans all T columns): the plain causal path, as the batch-1 decoder
        )
        if any(r.length != self.num_cols for r in rows):
            mask = batch_attention_mask(lengths, self.num_cols, 1, self.target.dtype)  # [B, 1, 1, T + 1]
        logits = forward_logits(self._fwd, ids, self.cache, lengths[:, None], mask)[:, -1, : self.vocab_size]
        tokens = logits.argmax(dim=-1)  # [B]; sampled rows overwrite theirs
        for b, row in enumerate(rows):
            if not row.greedy:
                tokens[b] = sample_tokens(process_logits(logits[b : b + 1], **row.settings), row.generator)[0]
        tokens = tokens.tolist()  # the step's one host sync
        self.num_cols += 1
        dt = time.perf_counter() - t0
        out = []
        for row, tok in zip(rows, tokens, strict=True):
            row.length += 1
            row.root = tok
            row.stats.target_forwards += 1
            row.stats.target_seconds += dt
            row.emit(tok)
            out.append((row, [tok]))
        self._keep([r for r in rows if not r.finished])
        return out

    # ------------------------------------------------------------------ convenience
    def generate(
        self, prompts: Sequence[Sequence[int]], settings: dict | Sequence[dict] | None = None
    ) -> list[list[int]]:
        """Decode `prompts` together to the end -> each row's generated ids. `settings`: add() keyword arguments,
        one dict for all rows or one per row."""
        if settings is None or isinstance(settings, dict):
            settings = [settings or {}] * len(prompts)
        rows = [self.add(p, **s) for p, s in zip(prompts, settings, strict=True)]
        while self.rows:
            self.step()
        return [r.generated for r in rows]
