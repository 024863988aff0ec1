"""Batched autoregressive decoding (DESIGN.md "Batched decoding and scheduling"): many rows, ONE target forward.

Rows have different prompt lengths, their own sampling settings (temperature, top-p, top-k), stop conditions,
max tokens and torch.Generator. They join and leave at step boundaries:

  add(prompt, ...)  prefill the new row alone (one batch-1 forward over prompt[:-1], as the batch-1 decoder does),
                    then merge its cache into the batch cache as a new row.
  add_many([...])   several new rows, prefilled by one forward over all their prompts (left-padded and masked
                    where their lengths differ), each then merged as add() does.
  step()            one target forward over every row's pending token; each row samples its own next token with
                    THE sampling transform (resispec.sampling) and its own generator, checks its own stops;
                    finished rows leave the batch.
  remove(row)       drop a row now (a cancelled request).
  prefill_part(...) chunked prefill: forward the next part of a prompt that has not joined yet into caches of its
                    own (PartialPrefill); passed to add_many as `partial`, the row's prefill then forwards only the
                    rest. A server runs one part per step boundary, so running rows wait at most one part's forward
                    for a long newcomer, not its whole prefill.

Cache layout (resispec.decoding.kv_cache, "batched caches"): one DynamicCache of T columns; rows are right-aligned
(row b owns the last lengths[b] columns, the padding before them is hidden by a 4D additive mask) and position ids
are per row, so a row sees exactly what it would see alone. When rows leave, the padding every remaining row shares is
dropped, so T is always the longest running row's length: memory is bounded by rows x longest row.

Exactness: a greedy row emits the target's greedy tokens (identical to decoding it alone and to HF generate, up to
floating-point differences between batch shapes); a sampled row draws from process_logits(target logits) with its
own generator, one draw per token (sampling.sample_at), exactly as SpeculativeDecoder's AR path does, so a
seeded row gives the same tokens whatever its neighbours. A row whose generator is a SeedStream (resispec.sampling)
draws the token at each position from noise keyed by that position, on the speculative batch too (it drafts and
verifies with the gumbel rule): its tokens are the same whether any step drafted or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from resispec.decoding.fast_forward import fast_forward
from resispec.decoding.kv_cache import (
    batch_attention_mask,
    crop_cache,
    forward_logits,
    gather_cache_columns,
    merge_cache_row,
    new_cache,
    select_cache_rows,
    split_cache_rows,
    trim_cache_left,
)
from resispec.decoding.lean import propose_at, row_rule, walk_greedy, walk_one_draw_chains, walk_sampled
from resispec.decoding.prefix_cache import PrefixCache
from resispec.decoding.stats import DecodeStats
from resispec.decoding.stopping import StopChecker, make_stop_string_checker, normalize_eos
from resispec.sampling import SeedStream, is_greedy, probs_by_settings, sample_at, sample_each
from resispec.sampling import probs as process_logits
from resispec.verify.base import top_set


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
    length: int = 0  # tokens of this row held in the (target) cache
    pending: list[int] = field(
        default_factory=list
    )  # speculative: committed tokens not yet in the draft cache
    started: float = field(default_factory=time.perf_counter)
    partial: PartialPrefill | None = None  # its prompt's prefill so far (chunked prefill), until it joins

    @property
    def greedy(self) -> bool:
        return is_greedy(self.settings["temperature"])

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


@dataclass(eq=False)
class PartialPrefill:
    """A prompt's prefill done in parts before its row joins (BatchedDecoder.prefill_part): per model kind
    ("target", "draft"), a batch-1 cache of the first `done` tokens of prompt[:-1], and the seconds and forwards
    spent on it (charged to the row's stats when it joins). `cached`: the tokens the first part found in the
    prefix cache."""

    prompt: list[int]
    done: int = 0
    cached: int = 0
    caches: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    forwards: dict = field(default_factory=dict)

    @property
    def remaining(self) -> int:
        """Prompt tokens the row's own prefill still has to forward (its last token is the root, never forwarded)."""
        return max(len(self.prompt) - 1 - self.done, 0)


def _prefill_part(models, part: PartialPrefill, tokens: int) -> None:
    """Forward the next `tokens` tokens of part.prompt[:-1] through each model (kind, forward, model, prefix cache)
    into the part's cache of that kind. The first part starts after the longest prefix of the prompt that every
    model's prefix cache holds."""
    seq = part.prompt[:-1]
    if not part.caches:
        found = []
        for kind, _, model, prefix in models:
            t0 = time.perf_counter()
            m, cache = prefix.lookup(seq) if prefix is not None else (0, None)
            found.append((kind, model, m, cache, time.perf_counter() - t0))
        part.done = part.cached = min(m for _, _, m, _, _ in found)
        for kind, model, m, cache, seconds in found:
            if part.done == 0:
                cache = new_cache(model)
            elif m > part.done:
                crop_cache(cache, part.done)
            part.caches[kind], part.seconds[kind], part.forwards[kind] = cache, seconds, 0
    end = min(part.done + max(tokens, 1), len(seq))
    if end > part.done:
        for kind, forward, model, _ in models:
            t0 = time.perf_counter()
            ids = torch.tensor([seq[part.done : end]], device=next(model.parameters()).device)
            forward_logits(forward, ids, part.caches[kind], logits_to_keep=1)
            part.seconds[kind] += time.perf_counter() - t0
            part.forwards[kind] += 1
        part.done = end


def _slot_order(old: list[BatchRow], keep: list[BatchRow], device) -> tuple[list[BatchRow], torch.Tensor]:
    """The rows `keep` (a subset of `old`) in the order that moves the fewest cache rows, and each one's slot in
    `old` (the index for select_cache_rows): a row keeps its slot, and the kept rows beyond the new batch size fill
    the slots of rows that left (so one row moves per row that left, not every row after it)."""
    n, kept = len(keep), {id(r) for r in keep}
    tail = [r for r in old[n:] if id(r) in kept]
    rows = [r if id(r) in kept else tail.pop() for r in old[:n]]
    slot = {id(r): i for i, r in enumerate(old)}
    return rows, torch.tensor([slot[id(r)] for r in rows], dtype=torch.long, device=device)


def _next_tokens(rows: list[BatchRow], logits: torch.Tensor) -> list[int]:
    """Each row's next token from its logits [B, V] at the position after its last one: argmax for greedy rows,
    one draw from the sampling transform with the row's own generator (sample_at) for the others: batched, each
    row's uniform from its own generator (row_uniforms: the token it draws alone), a SeedStream row by its own
    position-keyed draw. One host sync."""
    tokens = logits.argmax(dim=-1)  # [B]; sampled rows overwrite theirs
    batched = [b for b, r in enumerate(rows) if not r.greedy and not isinstance(r.generator, SeedStream)]
    if batched:
        p = probs_by_settings(logits[batched], [rows[b].settings for b in batched])
        tokens[batched] = sample_each(p, [rows[b].generator for b in batched])
    for b, row in enumerate(rows):
        if not row.greedy and isinstance(row.generator, SeedStream):
            p = process_logits(logits[b : b + 1], **row.settings)
            tokens[b] = sample_at(p, row.generator, row.length + 1)[0]
    return tokens.tolist()


def _left_padded(
    seqs: Sequence[Sequence[int]], starts: Sequence[int], device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block of token rows LEFT-padded to the longest, each row's last token in the block's last column ->
    (ids [B, W], positions [B, W] (row b from starts[b]), valid [B, W] bool, allowed [B, W, W] bool: a real token
    sees the row's real tokens up to itself; a padding query sees only itself, so no softmax row is empty)."""
    width = max(len(s) for s in seqs)
    pad = [width - len(s) for s in seqs]
    ids = torch.tensor([[0] * z + list(s) for s, z in zip(seqs, pad, strict=True)], device=device)
    pos = torch.tensor(
        [[0] * z + list(range(p, p + width - z)) for p, z in zip(starts, pad, strict=True)], device=device
    )
    valid = torch.tensor([[False] * z + [True] * (width - z) for z in pad], device=device)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    eye = torch.eye(width, dtype=torch.bool, device=device)
    return ids, pos, valid, (causal[None] & valid[:, None, :]) | eye[None]


def _prefill(forward, model, rows: list[BatchRow], kind: str, prefix: PrefixCache | None = None) -> list:
    """Batch-1 caches of every row's prompt but its last token (as the batch-1 decoder prefills), from ONE forward
    of `model` over all of them (left-padded, masked; one row: its plain batch-1 forward, as alone), for
    merge_cache_row. The forward's seconds are shared out to the rows' stats (`kind`: "target" | "draft").

    With a `prefix` cache, a row whose prompt begins with a stored prefix starts from that K/V: a prompt seen
    before needs no forward, one sharing a block-aligned prefix forwards only the rest (alone, after the stored
    columns); the rest are prefilled together as above, and every prompt's K/V is then stored. A row prefilled in
    parts (`row.partial`, prefill_part) starts from its part's cache the same way."""
    live = [r for r in rows if len(r.prompt) > 1]
    caches = {id(r): new_cache(model) for r in rows}
    if not live:
        return [caches[id(r)] for r in rows]
    dev = next(model.parameters()).device
    fresh, whole = (
        [],
        set(),
    )  # rows prefilled from scratch; rows whose prompt was found whole (stored already)
    for r in live:
        t0 = time.perf_counter()
        part = r.partial
        if part is not None and kind in part.caches:  # prefilled in parts so far (prefill_part)
            reused, cache, cached = part.done, part.caches[kind], part.cached
            _charge(r, kind, part.seconds[kind], part.forwards[kind])
        elif prefix is not None:
            reused, cache = prefix.lookup(r.prompt[:-1])
            cached = reused
            if reused == len(r.prompt) - 1:
                whole.add(id(r))
        else:
            reused = 0
        if not reused:
            fresh.append(r)
            continue
        rest = r.prompt[reused:-1]
        if rest:  # the rest of the prompt, after the columns it starts from
            forward_logits(forward, torch.tensor([rest], device=dev), cache, logits_to_keep=1)
        caches[id(r)] = cache
        _charge(r, kind, time.perf_counter() - t0, int(bool(rest)))
        if kind == "target":
            r.stats.cached_prompt_tokens = cached
    if fresh:
        t0 = time.perf_counter()
        seqs, block = [r.prompt[:-1] for r in fresh], new_cache(model)
        if len({len(s) for s in seqs}) == 1:  # one length (one row: as alone): the plain causal path
            forward_logits(forward, torch.tensor(seqs, device=dev), block, logits_to_keep=1)
        else:
            ids, pos, _, allowed = _left_padded(seqs, [0] * len(seqs), dev)
            forward_logits(forward, ids, block, pos, _additive(allowed, model.dtype), logits_to_keep=1)
        parts = [block] if len(fresh) == 1 else split_cache_rows(block, [len(s) for s in seqs])
        caches.update(zip([id(r) for r in fresh], parts, strict=True))
        share = (time.perf_counter() - t0) / len(fresh)
        for r in fresh:
            _charge(r, kind, share, 1)
    if prefix is not None:
        for r in live:
            if id(r) not in whole:
                prefix.store(r.prompt[:-1], caches[id(r)])
    return [caches[id(r)] for r in rows]


def _charge(row: BatchRow, kind: str, seconds: float, forwards: int) -> None:
    """Add a prefill's seconds and forwards to the row's stats (`kind`: "target" | "draft")."""
    setattr(row.stats, f"{kind}_seconds", getattr(row.stats, f"{kind}_seconds") + seconds)
    setattr(row.stats, f"{kind}_forwards", getattr(row.stats, f"{kind}_forwards") + forwards)


def _store_finished(
    prefix: PrefixCache | None, old: list[BatchRow], keep: list[BatchRow], cache, columns
) -> None:
    """Before rows leave a batch: store the target K/V of each finished one (its prompt and generated tokens, as far
    as the cache holds them) in `prefix`, for a later prompt that repeats them (a chat's next turn).
    columns(b, row) -> the cache columns holding row b's tokens, in order."""
    if prefix is None:
        return
    kept = {id(r) for r in keep}
    for b, row in enumerate(old):
        if id(row) in kept or not row.finished:
            continue
        # the cache holds the tokens before the last one (the root)
        seq = (row.prompt + row.generated)[: row.length]
        if len(seq) < len(row.prompt):
            continue

        def layers(b: int = b, row: BatchRow = row, n: int = len(seq)):
            cols = columns(b, row)[:n]
            return [
                (layer.keys[b : b + 1].index_select(2, cols), layer.values[b : b + 1].index_select(2, cols))
                for layer in cache.layers
            ]

        prefix.store_layers(seq, layers)


def _emit_one_each(
    rows: list[BatchRow], tokens: list[int], seconds: float
) -> list[tuple[BatchRow, list[int]]]:
    """The bookkeeping of an autoregressive step: each row takes its token as its new root."""
    out = []
    for row, tok in zip(rows, tokens, strict=True):
        row.length += 1
        row.root = tok
        row.stats.target_forwards += 1
        row.stats.target_seconds += seconds
        row.emit(tok)
        out.append((row, [tok]))
    return out


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
        self._target_fwd = forward if forward is not None else fast_forward(target)
        self._t_dtype = target.dtype  # read once: an HF model's .dtype walks its parameters
        self.rows: list[BatchRow] = []
        self.cache = new_cache(target)
        self.num_cols = 0  # T: columns of the batch cache
        self.prefix: PrefixCache | None = None  # stored prompt and finished-row K/V (enable_prefix_cache)

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
        return self.add_many(
            [
                dict(
                    prompt_ids=prompt_ids,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    eos_token_id=eos_token_id,
                    stop=stop,
                    stop_checker=stop_checker,
                    generator=generator,
                )
            ]
        )[0]

    @torch.inference_mode()
    def add_many(self, requests: Sequence[dict]) -> list[BatchRow]:
        """add() for several rows at once (each dict: add()'s keyword arguments, and `partial`: the PartialPrefill
        of its prompt from prefill_part, if any), prefilled by ONE forward over all their prompts (left-padded): at
        16 prompts of 64 tokens on the tiny target, 165 ms against 229 ms one by one. Every row is checked before
        anything runs, so a bad one adds none."""
        rows = [self._new_row(**kw) for kw in requests]
        self._join([r for r in rows if not r.finished])
        for r in rows:
            r.partial = None  # its caches are in the batch now
        return rows

    @torch.inference_mode()
    def prefill_part(self, prompt_ids, tokens: int, part: PartialPrefill | None = None) -> PartialPrefill:
        """Chunked prefill of a row that has not joined yet: forward the next `tokens` tokens of its prompt (but
        the last token, as a row's prefill) into `part`'s caches, a new part on the first call (which starts after
        the longest stored prefix) -> the part. add_many(..., partial=part) then forwards only `part.remaining`
        tokens. The result is the same as a prefill in one go, up to the float rounding of a different forward
        shape (as for a prefix-cache hit)."""
        if part is None:
            part = PartialPrefill(torch.as_tensor(prompt_ids).reshape(-1).tolist())
        _prefill_part(self._prefill_models(), part, tokens)
        return part

    def _prefill_models(self) -> list:
        """(kind, forward, model, prefix cache) of each model a joining row is prefilled with."""
        return [("target", self._target_fwd, self.target, self.prefix)]

    def _prefill_rows(self, rows: list[BatchRow]) -> dict[str, list]:
        """kind -> each row's batch-1 cache of its prompt (_prefill), for every model of _prefill_models."""
        return {
            kind: _prefill(fwd, model, rows, kind, prefix)
            for kind, fwd, model, prefix in self._prefill_models()
        }

    def _new_row(
        self,
        prompt_ids,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_token_id=None,
        stop=None,
        stop_checker: StopChecker | None = None,
        generator: torch.Generator | None = None,
        partial: PartialPrefill | None = None,
    ) -> BatchRow:
        prompt = torch.as_tensor(prompt_ids).reshape(-1).tolist()
        if not prompt:
            raise ValueError("empty prompt")
        if partial is not None and partial.prompt != prompt:
            raise ValueError("partial= is the prefill of another prompt")
        if eos_token_id is None:
            eos_token_id = getattr(getattr(self.target, "generation_config", None), "eos_token_id", None)
        checkers = [c for c in (stop_checker,) if c is not None]
        if stop:
            if self.tokenizer is None:
                raise ValueError("stop strings need BatchedDecoder(..., tokenizer=...) or a stop_checker")
            checkers.append(make_stop_string_checker(self.tokenizer, stop))
        return BatchRow(
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            settings=dict(temperature=temperature, top_k=top_k, top_p=top_p),
            eos=normalize_eos(eos_token_id),
            checkers=checkers,
            generator=generator,
            root=prompt[-1],
            length=len(prompt) - 1,
            finished=max_new_tokens <= 0,
            partial=partial,
        )

    def enable_prefix_cache(self, max_tokens: int) -> None:
        """Reuse the K/V of prompts prefilled before and of finished rows (resispec.decoding.prefix_cache), at most
        `max_tokens` tokens stored; 0 turns it off."""
        self.prefix = PrefixCache(max_tokens) if max_tokens > 0 else None

    def _join(self, rows: list[BatchRow]) -> None:
        """Prefill the new rows together and merge them into the batch cache."""
        caches = self._prefill_rows(rows)["target"]
        for row, row_cache in zip(rows, caches, strict=True):
            merge_cache_row(self.cache, len(self.rows), row_cache)
            self.num_cols = max(self.num_cols, row.length)
            self.rows.append(row)

    def remove(self, row: BatchRow) -> None:
        """Drop `row` from the batch now (a cancelled request); a row not in the batch is ignored."""
        self._keep([r for r in self.rows if r is not row])

    def _keep(self, rows: list[BatchRow]) -> None:
        if len(rows) == len(self.rows):
            return
        # row b owns the last r.length of the num_cols columns
        _store_finished(
            self.prefix,
            self.rows,
            rows,
            self.cache,
            lambda b, r: torch.arange(self.num_cols - r.length, self.num_cols, device=self.device),
        )
        rows, sel = _slot_order(self.rows, rows, self.device)
        select_cache_rows(self.cache, sel)
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
            mask = batch_attention_mask(lengths, self.num_cols, 1, self._t_dtype)  # [B, 1, 1, T + 1]
        logits = forward_logits(self._target_fwd, ids, self.cache, lengths[:, None], mask)[
            :, -1, : self.vocab_size
        ]
        tokens = _next_tokens(rows, logits)
        self.num_cols += 1
        out = _emit_one_each(rows, tokens, time.perf_counter() - t0)
        self._keep([r for r in rows if not r.finished])
        return out

    # ------------------------------------------------------------------ convenience
    def generate(
        self, prompts: Sequence[Sequence[int]], settings: dict | Sequence[dict] | None = None
    ) -> list[list[int]]:
        """Decode `prompts` together to the end (prefilled together: add_many) -> each row's generated ids.
        `settings`: add() keyword arguments, one dict for all rows or one per row."""
        if settings is None or isinstance(settings, dict):
            settings = [settings or {}] * len(prompts)
        rows = self.add_many([dict(s, prompt_ids=p) for p, s in zip(prompts, settings, strict=True)])
        while self.rows:
            self.step()
        return [r.generated for r in rows]


# ---------------------------------------------------------------------------- batched speculative decoding
class _HoleyCache:
    """A batch cache whose rows may have holes: `valid` [B, T] marks the columns each row attends to. Tree nodes
    are appended for every row and only the accepted ones become valid (keys carry their RoPE positions, so a
    row's valid columns in any order ARE its sequence); padding queries of shorter rows are never valid.
    Columns no row uses are cropped, and the cache is repacked right-aligned when holes outweigh tokens."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache = new_cache(model)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=next(model.parameters()).device)

    @property
    def num_cols(self) -> int:
        return self.valid.shape[1]

    def add_row(self, row_cache, length: int) -> None:
        """Merge a batch-1 cache holding `length` tokens as a new row (right-aligned)."""
        merge_cache_row(self.cache, self.valid.shape[0], row_cache)
        width = max(self.num_cols, length)
        old = torch.cat([self.valid.new_zeros(self.valid.shape[0], width - self.num_cols), self.valid], 1)
        new = torch.arange(width, device=self.valid.device) >= width - length
        self.valid = torch.cat([old, new[None]])

    def keep_rows(self, rows: torch.Tensor) -> None:
        select_cache_rows(self.cache, rows)
        self.valid = self.valid.index_select(0, rows)
        self.compact()

    def append(self, new_valid: torch.Tensor) -> None:
        """Record the columns the last forward appended ([B, Q])."""
        self.valid = torch.cat([self.valid, new_valid], 1)

    def allowed(self, num_new: int) -> torch.Tensor:
        """[B, Q, T + Q] bool: cached valid columns for every query; the new block is left False (caller fills)."""
        b = self.valid.shape[0]
        out = torch.zeros(b, num_new, self.num_cols + num_new, dtype=torch.bool, device=self.valid.device)
        out[:, :, : self.num_cols] = self.valid[:, None, :]
        return out

    def compact(self) -> None:
        """Drop columns no row uses at either end; repack right-aligned when holes exceed the tokens."""
        if self.valid.shape[0] == 0:
            self.cache, self.valid = new_cache(self.model), self.valid[:, :0]
            return
        used = self.valid.any(0).nonzero()
        if used.numel() == 0:
            first, last = self.num_cols, self.num_cols
        else:
            first, last = int(used[0]), int(used[-1]) + 1
        if last < self.num_cols:
            crop_cache(self.cache, last)
            self.valid = self.valid[:, :last]
        if first > 0:
            trim_cache_left(self.cache, first)
            self.valid = self.valid[:, first:]
        if self.num_cols == 0:  # nothing left: start over (a zero-length layer would keep a stale batch size)
            self.cache = new_cache(self.model)
            return
        counts = self.valid.sum(1)
        width = int(counts.max()) if counts.numel() else 0
        if self.num_cols > 2 * width + 16:
            # stable sort puts each row's holes first and its valid columns (in order) last
            order = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, -width:] if width else None
            if order is None:
                self.cache, self.valid = new_cache(self.model), self.valid[:, :0]
                return
            gather_cache_columns(self.cache, order)
            self.valid = self.valid.gather(1, order)


def _is_tree(flag) -> bool:
    """A per-depth branching such as (2, 1) or [4, 2, 1, 1] (not a list of per-row flags)."""
    return (
        isinstance(flag, (tuple, list))
        and len(flag) > 0
        and all(isinstance(b, int) and not isinstance(b, bool) for b in flag)
    )


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, Q, K] -> additive 4D mask [B, 1, Q, K]."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


@dataclass
class _DraftedStep:
    """One speculative step's trees, per row, and what their walks need of the drafting."""

    trees: list  # [DraftTree]
    rules: list  # the rule each row's walk runs (GREEDY_TOPK for greedy rows)
    greedy: list[bool]  # greedy rows: top-n children, walk_greedy
    chain: list[bool]  # rows whose draws and walk are batched (walk_one_draw_chains)
    chain_q: list[list[torch.Tensor]]  # those rows' q [1, V] per depth
    proposals: list[list]  # the other sampled rows' proposals, per depth
    fed: list[int]  # deepest tree level each row's draft has processed
    node_col: list[dict[int, int]]  # tree node -> draft cache column, this step


class BatchedSpeculativeDecoder:
    """Batched exact speculative decoding: per-row draft trees, one draft forward per depth and ONE target forward
    per step for all rows, per-row acceptance with the rule (greedy rows: GreedyTopK), per-row bookkeeping.

    Same row API as BatchedDecoder (add / step / remove / generate). Each row consumes its own generator in the same
    order as SpeculativeDecoder does alone (propose depth 1..D, then the verification walk), so a seeded row's
    output does not depend on its neighbours, and a greedy row equals the target's greedy decoding."""

    def __init__(
        self,
        target,
        draft,
        rule="resispec",
        tree: Sequence[int] = (2, 1),
        tokenizer=None,
        vocab_size: int | None = None,
        greedy_topk: bool = True,
    ) -> None:
        from resispec.decoding.engine import _resolve_rule
        from resispec.decoding.tree import max_tree_nodes, parse_tree
        from resispec.decoding.vocab import resolve_vocab_size

        self.target, self.draft = target.eval(), draft.eval()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or resolve_vocab_size(target, draft, tokenizer)
        self.rule = _resolve_rule(rule)
        self.shape = parse_tree(list(tree))
        self.max_nodes = max_tree_nodes(self.shape)
        self.greedy_topk = greedy_topk
        self.device = next(target.parameters()).device
        self._target_fwd, self._d_fwd = fast_forward(target), fast_forward(draft)
        self._t_dtype, self._d_dtype = target.dtype, draft.dtype  # read once: .dtype walks the parameters
        self.rows: list[BatchRow] = []
        self.tcache, self.dcache = _HoleyCache(target), _HoleyCache(draft)
        # prefill the draft when a row joins (_join); off for a batch that never drafts
        self.prefill_draft = True
        # stored prompt K/V of the target and the draft (enable_prefix_cache)
        self.prefix: PrefixCache | None = None
        self.draft_prefix: PrefixCache | None = None

    @classmethod
    def from_decoder(cls, decoder) -> BatchedSpeculativeDecoder:
        """The batched speculative path of a `SpeculativeDecoder` (same pair, rule, tree, vocabulary)."""
        dec = cls(
            decoder.target,
            decoder.draft,
            decoder.rule,
            decoder.shape,
            decoder.tokenizer,
            decoder.vocab_size,
            decoder.greedy_topk,
        )
        dec._target_fwd, dec._d_fwd = decoder._target_fwd, decoder._draft_fwd
        return dec

    def enable_prefix_cache(self, max_tokens: int) -> None:
        """BatchedDecoder.enable_prefix_cache, for the target and the draft (each its own `max_tokens`)."""
        BatchedDecoder.enable_prefix_cache(self, max_tokens)
        self.draft_prefix = PrefixCache(max_tokens) if self.prefix is not None else None

    # the row API of BatchedDecoder: add() / add_many() make the rows and call _join; generate() runs rows to the end
    add = BatchedDecoder.add
    add_many = BatchedDecoder.add_many
    prefill_part = BatchedDecoder.prefill_part
    _prefill_rows = BatchedDecoder._prefill_rows
    _new_row = BatchedDecoder._new_row
    generate = BatchedDecoder.generate

    def _prefill_models(self) -> list:
        models = [("target", self._target_fwd, self.target, self.prefix)]
        if self.prefill_draft:
            models.append(("draft", self._d_fwd, self.draft, self.draft_prefix))
        return models

    def _join(self, rows: list[BatchRow]) -> None:
        """The new rows join both caches, each prefilled by one forward over all their prompts. The draft is
        prefilled here on the prompt but its last token (as the target): folded into the next drafting step
        instead, the prompt would be a block that every other row is padded to (at 16 rows and 65-token prompts, a
        draft forward over ~1000 positions in the step of each newcomer). Without `prefill_draft` (a batch that
        never drafts) the prompt waits in the row's `pending`, the tokens the draft has not seen, and a drafting
        step takes them all."""
        caches = self._prefill_rows(rows)
        tcaches, dcaches = caches["target"], caches.get("draft")
        for b, row in enumerate(rows):
            self.tcache.add_row(tcaches[b], row.length)
            if dcaches is None:
                self.dcache.add_row(new_cache(self.draft), 0)
                row.pending = list(row.prompt)  # committed tokens not yet in the draft cache
            else:
                self.dcache.add_row(dcaches[b], row.length)
                row.pending = row.prompt[-1:]
            row.stats.accepted_per_position = [0] * len(self.shape)
            row.stats.reached_per_position = [0] * len(self.shape)
            self.rows.append(row)

    def remove(self, row: BatchRow) -> None:
        self._keep([r for r in self.rows if r is not row])

    def _keep(self, rows: list[BatchRow]) -> None:
        if len(rows) == len(self.rows):
            return
        # a row's valid columns, in column order, are its tokens in order (tree levels are appended by depth)
        valid = self.tcache.valid
        _store_finished(
            self.prefix, self.rows, rows, self.tcache.cache, lambda b, r: valid[b].nonzero().squeeze(1)
        )
        rows, sel = _slot_order(self.rows, rows, self.device)
        self.tcache.keep_rows(sel)
        self.dcache.keep_rows(sel)
        self.rows = rows

    def reset(self) -> None:
        self.rows = []
        self.tcache, self.dcache = _HoleyCache(self.target), _HoleyCache(self.draft)

    @property
    def kv_tokens(self) -> int:
        return len(self.rows) * (self.tcache.num_cols + self.dcache.num_cols)

    @property
    def in_lockstep(self) -> bool:
        """Every row attends to all the target cache's columns but at most one (no hole, at most one token of
        padding): rows of one length, as equal requests admitted together stay under autoregressive steps (up to
        one step, for a request that reached the server a step later)."""
        valid = self.tcache.valid
        return valid.shape[0] == 0 or int(valid.sum(1).min()) >= valid.shape[1] - 1

    def _probs(self, logits: torch.Tensor, settings: dict) -> torch.Tensor:
        return process_logits(logits[..., : self.vocab_size], **settings)

    @torch.inference_mode()
    def step(self, draft: bool | Sequence[bool] = True) -> list[tuple[BatchRow, list[int]]]:
        """One speculative step for every row -> [(row, its emitted tokens)]; finished rows leave the batch.

        draft: one entry for all rows or one per row: True drafts the decoder's tree, False takes a plain
        autoregressive step (a one-token verify), a tree (per-depth branching, e.g. (2, 1)) drafts that tree this
        step. When no row drafts, the step is BatchedDecoder's (`_ar_step`: no draft forward, trees or walks) and
        the tokens the draft has not seen pile up in each row's `pending`, fed with the next drafting step. So the
        caller can switch speculation off and on, or change the tree, between steps (by load) without leaving
        exactness: every step is an exact step of its own tree.

        The phases: _draft (one draft forward per depth, every row's tree), _verify (ONE target forward over
        every row's tree), _walk_chains (the one-draw chains' walks in batched ops), _accept (every other row's
        walk, then both caches compacted)."""
        from resispec.decoding.tree import parse_tree

        rows = self.rows
        if not rows:
            return []
        t0 = time.perf_counter()
        flags = [draft] * len(rows) if isinstance(draft, bool) or _is_tree(draft) else list(draft)
        shapes = [self.shape if f is True else parse_tree(list(f)) if f else [] for f in flags]
        lims = [
            min(len(sh), r.max_new_tokens - len(r.generated) - 1) for r, sh in zip(rows, shapes, strict=True)
        ]
        if not any(
            lims
        ):  # the draft does not run this step (when it does, it takes every row's pending tokens)
            return self._ar_step(rows, flags, t0)
        step = self._draft(rows, shapes, lims)
        t1 = time.perf_counter()
        logits = self._verify(rows, step.trees)
        t2 = time.perf_counter()
        walks = self._walk_chains(rows, step, logits)
        return self._accept(rows, step, logits, walks, flags, (t0, t1, t2))

    def _draft(self, rows: list[BatchRow], shapes: list[list[int]], lims: list[int]) -> _DraftedStep:
        """Every row's tree of this step: the draft's forward over each row's pending tokens, then one forward per
        depth over the levels that have children to draft."""
        from resispec.decoding.engine import GREEDY_TOPK
        from resispec.decoding.tree import DraftTree, max_tree_nodes

        dev, nb = self.device, len(rows)
        greedy = [r.greedy and self.greedy_topk for r in rows]
        rules = [
            GREEDY_TOPK if g else row_rule(self.rule, r.generator) for r, g in zip(rows, greedy, strict=True)
        ]
        q_set = [
            dict(temperature=1.0, top_k=0, top_p=1.0) if g else r.settings
            for r, g in zip(rows, greedy, strict=True)
        ]
        step = _DraftedStep(
            trees=[DraftTree(r.root, max_tree_nodes(sh)) for r, sh in zip(rows, shapes, strict=True)],
            rules=rules,
            greedy=greedy,
            # rows whose draws and walk are batched (walk_one_draw_chains): sampled and unseeded, drafting a chain
            # of one-draw nodes with a rule whose one-draw step is standard speculative sampling, or not drafting
            chain=[
                not g
                and not isinstance(r.generator, SeedStream)
                and (lim == 0 or (getattr(rule, "one_draw_is_standard", False) and set(sh[:lim]) == {1}))
                for r, g, rule, sh, lim in zip(rows, greedy, rules, shapes, lims, strict=True)
            ],
            chain_q=[[] for _ in rows],
            proposals=[[] for _ in rows],
            fed=[0] * nb,
            node_col=[{} for _ in rows],
        )
        trees, chain, fed, node_col = step.trees, step.chain, step.fed, step.node_col
        # ---- depth 0: every row's pending committed tokens, LEFT-padded so that every row's last one is the
        # block's last column and only that column goes through the LM head (a newcomer's prompt pads every other
        # row to its length: full logits there cost more than the draft's layers)
        ids, pos, new_valid, block = _left_padded(
            [r.pending for r in rows], [r.length + 1 - len(r.pending) for r in rows], dev
        )
        width = ids.shape[1]
        allowed = self.dcache.allowed(width)
        t_old = self.dcache.num_cols
        allowed[:, :, t_old:] = block
        logits = forward_logits(
            self._d_fwd, ids, self.dcache.cache, pos, _additive(allowed, self._d_dtype), logits_to_keep=1
        )
        self.dcache.append(new_valid)
        q_all = probs_by_settings(logits[:, -1, : self.vocab_size], q_set)  # [B, V]
        qs = [q_all[b : b + 1] for b in range(nb)]
        growing = [lim > 0 for lim in lims]
        for depth in range(1, max(lims) + 1):
            # the chain rows' draws at this depth at once, each row's uniform from its own generator
            draw = [b for b in range(nb) if chain[b] and growing[b] and depth <= lims[b]]
            drawn = {}
            if draw:
                q_draw = torch.cat([qs[b] for b in draw])
                tokens = sample_each(q_draw, [rows[b].generator for b in draw]).tolist()
                drawn = dict(zip(draw, tokens, strict=True))
            # the greedy rows' children at this depth (the top-n of q, GreedyRule.propose), one top_set per width;
            # their walk needs no proposal (walk_greedy)
            tops: dict[int, list] = {}
            by_width: dict[int, list[int]] = {}
            for b in range(nb):
                if greedy[b] and growing[b] and depth <= lims[b]:
                    by_width.setdefault(shapes[b][depth - 1], []).append(b)
            for n, group in by_width.items():
                ids = top_set(torch.cat([qs[b] for b in group]), n).tolist()
                at = 0
                for b in group:
                    tops[b], at = ids[at : at + qs[b].shape[0]], at + qs[b].shape[0]
            feed = []  # (row, level) pairs the draft processes at this depth
            for b, r in enumerate(rows):
                if not growing[b] or depth > lims[b]:
                    growing[b] = False
                    continue
                if b in drawn:
                    level = trees[b].add_level([[drawn[b]]])
                    step.chain_q[b].append(qs[b])
                elif b in tops:
                    level = trees[b].add_level(tops[b])
                else:
                    proposal = propose_at(
                        rules[b], qs[b], shapes[b][depth - 1], r.generator, r.length + depth
                    )
                    level = trees[b].add_level(proposal.token_ids.tolist())
                    step.proposals[b].append(proposal)
                if len(level) == 0:
                    growing[b] = False
                    continue
                if depth < lims[b]:
                    feed.append((b, level))
                else:
                    growing[b] = False
            if not feed:
                break
            width = max(len(level) for _, level in feed)
            t_old = self.dcache.num_cols
            ids_l, pos_l = [[0] * width for _ in rows], [[0] * width for _ in rows]
            allowed = self.dcache.allowed(width)
            allowed[:, :, t_old:] = torch.eye(width, dtype=torch.bool, device=dev)[None]  # a node sees itself
            for b, level in feed:
                tree, n = trees[b], len(level)
                ids_l[b][:n] = tree.tokens[level.start : level.stop]
                pos_l[b][:n] = [rows[b].length + depth] * n
                if level.start > 1:  # the level's ancestors among the earlier non-root nodes
                    cols = [node_col[b][j] for j in range(1, level.start)]
                    allowed[b, :n, cols] |= tree.mask(level, range(1, level.start)).to(dev)
            ids, pos = torch.tensor(ids_l, device=dev), torch.tensor(pos_l, device=dev)
            logits = forward_logits(
                self._d_fwd, ids, self.dcache.cache, pos, _additive(allowed, self._d_dtype)
            )
            self.dcache.append(torch.zeros(nb, width, dtype=torch.bool, device=dev))
            fed_rows = [b for b, _ in feed]
            q_fed = probs_by_settings(logits[fed_rows, :, : self.vocab_size], [q_set[b] for b in fed_rows])
            for i, (b, level) in enumerate(feed):
                for j, node in enumerate(level):
                    node_col[b][node] = t_old + j
                qs[b] = q_fed[i, : len(level)]
                fed[b] = depth
        return step

    def _verify(self, rows: list[BatchRow], trees: list) -> torch.Tensor:
        """ONE target forward over every row's root and tree nodes -> logits [B, widest tree, V]. Ids and positions
        are built as lists and sent as one tensor each; a root alone needs no mask beyond the diagonal (per-row
        tensor ops cost ~10 us each, 16 rows x several per step)."""
        dev = self.device
        width = max(t.num_nodes for t in trees)
        tails = [[0] * (width - t.num_nodes) for t in trees]  # each row's padding after its nodes
        ids = torch.tensor([t.tokens + z for t, z in zip(trees, tails, strict=True)], device=dev)
        pos = torch.tensor(
            [[d + r.length for d in t.depths] + z for r, t, z in zip(rows, trees, tails, strict=True)],
            device=dev,
        )
        t_old = self.tcache.num_cols
        allowed = self.tcache.allowed(width)
        allowed[:, :, t_old:] = torch.eye(width, dtype=torch.bool, device=dev)[None]
        for b, tree in enumerate(trees):
            n = tree.num_nodes
            if n > 1:
                allowed[b, :n, t_old : t_old + n] = tree.mask(range(n), range(n)).to(dev)
        return forward_logits(
            self._target_fwd, ids, self.tcache.cache, pos, _additive(allowed, self._t_dtype)
        )

    def _walk_chains(
        self, rows: list[BatchRow], step: _DraftedStep, logits: torch.Tensor
    ) -> dict[int, tuple[list[int], list[int]]]:
        """The chain rows' walks (row index -> (run, accepted)), grouped by chain depth, in batched ops
        (walk_one_draw_chains)."""
        walks: dict[int, tuple[list[int], list[int]]] = {}
        by_depth: dict[int, list[int]] = {}
        for b, tree in enumerate(step.trees):
            if step.chain[b]:
                by_depth.setdefault(tree.depth, []).append(b)
        for d, idx in by_depth.items():
            p = probs_by_settings(logits[idx, : d + 1, : self.vocab_size], [rows[b].settings for b in idx])
            drafted = torch.tensor(
                [step.trees[b].tokens[1 : d + 1] for b in idx], device=self.device
            )  # depth d
            q = torch.stack([torch.cat(step.chain_q[b]) for b in idx]) if d else None
            walked = walk_one_draw_chains(p, drafted, q, [rows[b].generator for b in idx])
            walks.update(zip(idx, walked, strict=True))
        return walks

    def _accept(
        self,
        rows: list[BatchRow],
        step: _DraftedStep,
        logits: torch.Tensor,
        walks: dict[int, tuple[list[int], list[int]]],
        flags: list,
        times: tuple[float, float, float],
    ) -> list[tuple[BatchRow, list[int]]]:
        """Every other row's walk (greedy: argmax p at every node, one host sync for the batch; sampled: the lean
        step's walk, the same randomness as the row decoded alone), then each row's tokens, stats and caches: the
        accepted nodes stay valid, both caches are compacted, finished rows leave."""
        t0, t1, t2 = times
        trees, fed, node_col = step.trees, step.fed, step.node_col
        best = logits[:, :, : self.vocab_size].argmax(-1).tolist() if any(step.greedy) else None
        t_valid = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=self.device)
        out = []
        for b, (r, tree) in enumerate(zip(rows, trees, strict=True)):
            if b in walks:
                run, accepted = walks[b]
            elif step.greedy[b]:
                run, accepted = walk_greedy(tree, best[b][: tree.num_nodes])
            else:

                def p_at(nodes: list[int], b: int = b, r: BatchRow = r) -> torch.Tensor:
                    return self._probs(logits[b, nodes], r.settings)

                run, accepted = walk_sampled(
                    step.rules[b], tree, p_at, step.proposals[b], r.generator, r.length + 1
                )
            t_valid[b, [0] + accepted] = True
            for n in accepted:
                if tree.depths[n] <= fed[b]:
                    self.dcache.valid[b, node_col[b][n]] = True
            r.length += len(accepted) + 1
            r.root = run[-1]
            s = r.stats
            s.target_forwards += 1
            s.target_seconds += t2 - t1
            r.pending = [tree.tokens[n] for n in accepted if tree.depths[n] > fed[b]] + [run[-1]]
            if flags[b]:
                s.record_step(tree.num_nodes, len(accepted), tree.depth)
                s.draft_forwards += 1 + fed[b]
                s.draft_seconds += t1 - t0
            chunk = []
            for tok in run:
                chunk.append(tok)
                if r.emit(tok):
                    break
            out.append((r, chunk))
        self.tcache.append(t_valid)
        self.tcache.compact()
        self.dcache.compact()
        self._keep([r for r in rows if not r.finished])
        return out

    def _ar_step(self, rows: list[BatchRow], flags: list, t0: float) -> list[tuple[BatchRow, list[int]]]:
        """A step in which no row drafts: BatchedDecoder's step on the holey cache (one query per row, its valid
        columns and itself; the token as the one-node walk would choose it, sampling.sample_at at the same
        position). The new column is valid in every row, so there is nothing to compact; the draft owes each row
        its new token (pending)."""
        dev, valid = self.device, self.tcache.valid
        ids = torch.tensor([[r.root] for r in rows], device=dev)
        pos = torch.tensor([[r.length] for r in rows], device=dev)
        new = valid.new_ones(len(rows), 1)
        allowed = torch.cat([valid, new], 1)[:, None]  # [B, 1, T + 1]
        mask = _additive(allowed, self._t_dtype)
        logits = forward_logits(self._target_fwd, ids, self.tcache.cache, pos, mask)[:, -1, : self.vocab_size]
        tokens = _next_tokens(rows, logits)
        self.tcache.append(new)
        out = _emit_one_each(rows, tokens, time.perf_counter() - t0)
        for r, flag in zip(rows, flags, strict=True):
            r.pending.append(r.root)
            # asked to draft, but the emit budget left no room: an empty tree, as the batch-1 decoder records
            if flag:
                r.stats.record_step(1, 0, 0)
        self._keep([r for r in rows if not r.finished])
        return out
