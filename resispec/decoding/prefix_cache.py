"""Prompt prefix caching for the batched decoders: the K/V of prompts already prefilled, reused by later prompts that
begin with the same tokens, so their prefill computes only what is new.

This is vLLM's automatic prefix caching and SGLang's radix cache, in the small: a prompt's K/V is stored once,
findable by every block boundary of it (`block_size` tokens, 16 as vLLM's default) and by its full length. A new
prompt reuses the longest stored prefix: all of it when the same prompt was seen before (no forward at all), else the
longest block-aligned prefix it shares with a stored one (a system prompt, a few-shot header), and its prefill then
runs over the rest only. Entries are evicted least recently used first, to stay within `max_tokens` tokens per model.

Exactness: a token's K/V depends only on the tokens up to it (causal attention), so a stored prefix's K/V is what
prefilling it again would compute, up to the float rounding of a different batch shape (the same difference as a
prompt prefilled alone or left-padded among others). Lookups hash chained blocks, but a hit is only taken after the
stored tokens were compared with the prompt's, so a hash collision can never reuse the wrong K/V.

A finished request's prompt and generated tokens are stored too (the target's K/V, as it leaves the batch: the
batched decoders' `_keep`), so a multi-turn chat's next turn, whose prompt repeats the conversation so far, reuses
it up to the last whole block the two share (as vLLM, which caches the blocks a request generates). The memory is
the decoder's own, beside the batch cache and outside `server.kv_budget_tokens`: max_tokens x (K/V bytes per token)
per model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from resispec.decoding.kv_cache import cache_of

BLOCK_SIZE = 16


@dataclass(eq=False)
class _Entry:
    tokens: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [1, H, len(tokens), D]
    keys: list[tuple[int, int]]  # its index keys (length, chained hash)


class PrefixCache:
    """Stored prompt K/V of one model, at most `max_tokens` tokens in all (least recently used evicted first).

    `lookup(seq)` -> (m, cache): the longest stored prefix of `seq` (m tokens, 0 when none) as a batch-1 cache whose
    layers are views of the stored tensors (never written: appending to them copies); `store(seq, cache)` keeps a
    copy of a batch-1 cache holding exactly `seq`. `queries` / `hits` count tokens looked up and found (vLLM's
    prefix_cache_queries / prefix_cache_hits)."""

    def __init__(self, max_tokens: int, block_size: int = BLOCK_SIZE) -> None:
        if max_tokens < 0:
            raise ValueError(f"prefix cache size must be >= 0 tokens, got {max_tokens}")
        if block_size < 1:
            raise ValueError(f"prefix cache block size must be >= 1, got {block_size}")
        self.max_tokens, self.block_size = max_tokens, block_size
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # id -> entry, least recently used first
        # (prefix length, chained hash) -> the entries holding that prefix (ids, oldest first): when the newest is
        # evicted, an older one still answers
        self._index: dict[tuple[int, int], dict[int, None]] = {}
        self._next_id = 0
        self.num_tokens = 0  # tokens stored
        self.queries = 0  # tokens looked up
        self.hits = 0  # tokens found

    def __len__(self) -> int:
        return len(self._entries)

    def _keys(self, seq: Sequence[int]) -> list[tuple[int, int]]:
        """(length, hash) of every block boundary of `seq` and of its full length, longest first."""
        bs, h, keys = self.block_size, 0, []
        for start in range(0, len(seq) - len(seq) % bs, bs):
            h = hash((h, tuple(seq[start : start + bs])))
            keys.append((start + bs, h))
        if len(seq) % bs:
            keys.append((len(seq), hash((h, tuple(seq[len(seq) - len(seq) % bs :])))))
        return keys[::-1]

    def lookup(self, seq: Sequence[int]) -> tuple[int, DynamicCache | None]:
        self.queries += len(seq)
        if not self._entries:
            return 0, None
        seq = tuple(seq)
        for key in self._keys(seq):
            m = key[0]
            for entry_id in reversed(self._index.get(key, ())):
                entry = self._entries[entry_id]
                if entry.tokens[:m] != seq[:m]:  # a hash collision: never reuse what was not compared
                    continue
                self._entries.move_to_end(entry_id)
                self.hits += m
                return m, cache_of([(k[..., :m, :], v[..., :m, :]) for k, v in entry.layers])
        return 0, None

    def store(self, seq: Sequence[int], cache: DynamicCache) -> None:
        """Keep a copy of `cache` (batch 1, holding exactly `seq`'s K/V) unless the same tokens are stored already
        or it alone exceeds max_tokens; evict the least recently used entries beyond max_tokens."""
        self.store_layers(seq, lambda: [(layer.keys, layer.values) for layer in cache.layers])

    def store_layers(
        self, seq: Sequence[int], layers: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]
    ) -> None:
        """store() from `layers()`, the per-layer (keys, values) [1, H, len(seq), D], called only if the tokens are
        to be stored (extracting a row from a batch cache costs a gather)."""
        seq = tuple(seq)
        n = len(seq)
        if n == 0 or n > self.max_tokens:
            return
        keys = self._keys(seq)
        for same in self._index.get(keys[0], ()):
            if self._entries[same].tokens == seq:
                self._entries.move_to_end(same)
                return
        copies = []
        for k, v in layers():
            if k is None or k.shape[0] != 1 or k.shape[-2] != n:
                raise ValueError(
                    f"store() needs a batch-1 cache of the {n} tokens, got keys {getattr(k, 'shape', None)}"
                )
            copies.append((k.clone(), v.clone()))
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._entries[entry_id] = _Entry(seq, copies, keys)
        for key in keys:
            self._index.setdefault(key, {})[entry_id] = None
        self.num_tokens += n
        while self.num_tokens > self.max_tokens:
            self._evict(next(iter(self._entries)))

    def _evict(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.num_tokens -= len(entry.tokens)
        for key in entry.keys:
            ids = self._index[key]
            del ids[entry_id]
            if not ids:
                del self._index[key]
