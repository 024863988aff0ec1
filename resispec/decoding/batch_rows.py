"""Rows of a batch and what the batched decoders share (docs/design.md "Batched decoding and scheduling"): `BatchRow`,
the chunked prefill's `PartialPrefill`, the batched prefill, and `RowBatch`, the base of BatchedDecoder (batch_ar.py)
and BatchedSpeculativeDecoder (batch_spec.py). Rows have different prompt lengths, their own sampling settings
(temperature, top-p, top-k), stop conditions, max tokens and torch.Generator. They join and leave at step boundaries:

  add(prompt, ...)  prefill the new row alone (one batch-1 forward over prompt[:-1], as the batch-1 decoder does),
                    then merge its cache into the batch cache as a new row.
  add_many([...])   several new rows, prefilled by one forward over all their prompts (left-padded and masked
                    where their lengths differ), each then merged as add() does.
  step()            the subclass's step for every row; finished rows leave the batch.
  remove(row)       drop a row now (a cancelled request).
  prefill_part(...) chunked prefill: forward the next part of a prompt that has not joined yet into caches of its
                    own (PartialPrefill); passed to add_many as `partial`, the row's prefill then forwards only the
                    rest. A server runs one part per step boundary, so running rows wait at most one part's forward
                    for a long newcomer, not its whole prefill.

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
from resispec.decoding.kv_cache import crop_cache, forward_logits, new_cache, split_cache_rows
from resispec.decoding.prefix_cache import PrefixCache
from resispec.decoding.stats import DecodeStats
from resispec.decoding.stopping import StopChecker, model_eos, normalize_eos, stop_checkers
from resispec.sampling import SeedStream, is_greedy, probs_by_settings, sample_at, sample_each
from resispec.sampling import probs as process_logits


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


def left_padded(
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


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, Q, K] -> additive 4D mask [B, 1, Q, K]."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def prefill_caches(
    forward, model, rows: list[BatchRow], kind: str, prefix: PrefixCache | None = None
) -> list:
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
            ids, pos, _, allowed = left_padded(seqs, [0] * len(seqs), dev)
            forward_logits(forward, ids, block, pos, additive_mask(allowed, model.dtype), logits_to_keep=1)
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


class RowBatch:
    """What BatchedDecoder and BatchedSpeculativeDecoder share: the rows, their join (add / add_many, chunked
    prefill_part, the prefix cache), their leaving (remove, finished rows after a step) and `generate`.

    A subclass provides `step`, `reset`, `kv_tokens`, `_join` (merge the new rows' prefilled caches),
    `_keep_cache_rows` (its caches after rows left), `_row_columns` and `_target_cache` (where a finished row's
    target K/V is, for the prefix cache), and, when it prefills more than the target, `_prefill_models`.

    vocab_size: logits are cut to this size before sampling (the pair's shared vocabulary). tokenizer: needed only
    for stop strings. forward: the target's forward (default the decoder's own fast forward)."""

    def __init__(self, target: torch.nn.Module, tokenizer, vocab_size: int, forward: Callable | None) -> None:
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = next(target.parameters()).device
        self._target_fwd = forward if forward is not None else fast_forward(target)
        self._t_dtype = target.dtype  # read once: an HF model's .dtype walks its parameters
        self.rows: list[BatchRow] = []
        self.prefix: PrefixCache | None = None  # stored prompt and finished-row K/V (enable_prefix_cache)

    @property
    def target_forward(self) -> Callable:
        """The target's forward the batch runs."""
        return self._target_fwd

    # ------------------------------------------------------------------ rows join
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

    def enable_prefix_cache(self, max_tokens: int) -> None:
        """Reuse the K/V of prompts prefilled before and of finished rows (resispec.decoding.prefix_cache), at most
        `max_tokens` tokens stored; 0 turns it off."""
        self.prefix = PrefixCache(max_tokens) if max_tokens > 0 else None

    def _prefill_models(self) -> list:
        """(kind, forward, model, prefix cache) of each model a joining row is prefilled with."""
        return [("target", self._target_fwd, self.target, self.prefix)]

    def _prefill_rows(self, rows: list[BatchRow]) -> dict[str, list]:
        """kind -> each row's batch-1 cache of its prompt (prefill_caches), for every model of _prefill_models."""
        return {
            kind: prefill_caches(fwd, model, rows, kind, prefix)
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
            eos_token_id = model_eos(self.target)
        return BatchRow(
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            settings=dict(temperature=temperature, top_k=top_k, top_p=top_p),
            eos=normalize_eos(eos_token_id),
            checkers=stop_checkers(self.tokenizer, stop, stop_checker, type(self).__name__),
            generator=generator,
            root=prompt[-1],
            length=len(prompt) - 1,
            finished=max_new_tokens <= 0,
            partial=partial,
        )

    def _join(self, rows: list[BatchRow]) -> None:
        """Prefill the new rows together (_prefill_rows) and merge them into the batch's caches."""
        raise NotImplementedError

    # ------------------------------------------------------------------ rows leave
    def remove(self, row: BatchRow) -> None:
        """Drop `row` from the batch now (a cancelled request); a row not in the batch is ignored."""
        self._keep([r for r in self.rows if r is not row])

    def _keep(self, rows: list[BatchRow]) -> None:
        """Keep only `rows` (finished rows leave after a step): store the finished rows' K/V in the prefix cache,
        then select the kept rows' cache rows, moving the fewest (_slot_order)."""
        if len(rows) == len(self.rows):
            return
        _store_finished(self.prefix, self.rows, rows, self._target_cache(), self._row_columns)
        self.rows, sel = _slot_order(self.rows, rows, self.device)
        self._keep_cache_rows(sel)

    def _target_cache(self):
        """The target's batch cache (a DynamicCache)."""
        raise NotImplementedError

    def _row_columns(self, b: int, row: BatchRow) -> torch.Tensor:
        """The target cache's columns holding row b's tokens, in order."""
        raise NotImplementedError

    def _keep_cache_rows(self, sel: torch.Tensor) -> None:
        """Select cache rows `sel` (the kept rows' old slots, in the order of self.rows) in every cache."""
        raise NotImplementedError

    # ------------------------------------------------------------------ steps
    def _emit_ar(
        self, rows: list[BatchRow], logits: torch.Tensor, t0: float
    ) -> list[tuple[BatchRow, list[int]]]:
        """An autoregressive step's tokens from its logits [B, V] (each row's own sampling, _next_tokens) and
        their bookkeeping (each token the row's new root)."""
        tokens = _next_tokens(rows, logits)
        return _emit_one_each(rows, tokens, time.perf_counter() - t0)

    def step(self) -> list[tuple[BatchRow, list[int]]]:
        raise NotImplementedError

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
