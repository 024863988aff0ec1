"""Prefix caching (resispec.decoding.prefix_cache): stored prompt K/V is found by exact prompt and by block-aligned
prefix, never by a hash alone, stays within its token budget (least recently used evicted), is never written by
the rows that reuse it, and batched decoding with it emits exactly what it emits without it."""

from __future__ import annotations

import pytest
import torch

from resispec.decoding.batch import BatchedDecoder, BatchedSpeculativeDecoder
from resispec.decoding.kv_cache import forward_logits, new_cache
from resispec.decoding.prefix_cache import PrefixCache
from tests.unit.test_decoding_helpers import micro_llama, one_thread_per_module  # noqa: F401 (autouse fixture)

VOCAB = 64
NEW = 20


@pytest.fixture(scope="module")
def models():
    target = micro_llama(64, 2, VOCAB, seed=0, attention_gain=(8.0, 4.0))  # positions and masks count
    draft = micro_llama(32, 1, VOCAB, seed=1)
    return target, draft


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _kv(model, seq: list[int]):
    cache = new_cache(model)
    forward_logits(model, torch.tensor([seq]), cache)
    return cache


def test_lookup_finds_the_whole_prompt_or_its_longest_stored_block_prefix(models):
    target, _ = models
    pc = PrefixCache(1000, block_size=8)
    a = _prompt(37, 0)
    assert pc.lookup(a) == (0, None) and (pc.queries, pc.hits) == (37, 0)
    pc.store(a, _kv(target, a))
    n, cache = pc.lookup(a)  # the same prompt: all of it
    assert n == 37 and cache.get_seq_length() == 37
    assert torch.equal(cache.layers[0].keys, _kv(target, a).layers[0].keys)
    assert pc.lookup(a[:30] + [(a[30] + 1) % VOCAB] + a[31:])[0] == 24  # differs at 30: blocks 0-23 reused
    assert pc.lookup(a[:20])[0] == 16  # a shorter prompt: its whole blocks
    assert pc.lookup(a + _prompt(5, 1))[0] == 32  # a longer one: the stored blocks (not the partial last one)
    assert pc.lookup([(a[0] + 1) % VOCAB] + a[1:])[0] == 0  # differs at its first token: nothing
    assert pc.lookup(a[:7])[0] == 0  # shorter than one block, and not a stored prompt
    assert (pc.queries, pc.hits) == (37 + 37 + 37 + 20 + 42 + 37 + 7, 37 + 24 + 16 + 32)


def test_a_hash_collision_never_reuses_other_tokens(models):
    target, _ = models

    class Colliding(PrefixCache):
        def _keys(self, seq):  # every prefix of every prompt hashes alike
            return [(n, 0) for n in range(len(seq), 0, -1) if n % self.block_size == 0 or n == len(seq)]

    pc = Colliding(1000, block_size=4)
    a, b = _prompt(12, 2), _prompt(12, 3)
    pc.store(a, _kv(target, a))
    assert pc.lookup(b)[0] == 0
    assert pc.lookup(a[:8] + b[8:])[0] == 8


def test_budget_evicts_the_least_recently_used(models):
    target, _ = models
    pc = PrefixCache(30, block_size=4)
    a, b, c = _prompt(12, 4), _prompt(12, 5), _prompt(12, 6)
    pc.store(a, _kv(target, a))
    pc.store(b, _kv(target, b))
    pc.store(a, _kv(target, a))  # already held: only marked as used, not stored twice
    assert (len(pc), pc.num_tokens) == (2, 24)
    pc.store(c, _kv(target, c))  # 36 > 30: b, the least recently used, goes
    assert (len(pc), pc.num_tokens) == (2, 24)
    assert pc.lookup(b)[0] == 0 and pc.lookup(a)[0] == 12 and pc.lookup(c)[0] == 12
    pc.store(_prompt(31, 7), _kv(target, _prompt(31, 7)))  # larger than the whole budget: not stored
    assert (len(pc), pc.num_tokens) == (2, 24)
    with pytest.raises(ValueError, match="batch-1 cache of the 5 tokens"):
        pc.store(_prompt(5, 8), _kv(target, _prompt(6, 8)))
    with pytest.raises(ValueError, match=">= 0 tokens"):
        PrefixCache(-1)


@torch.inference_mode()
def test_rows_that_reuse_a_prefix_never_write_into_it(models):
    target, _ = models
    pc = PrefixCache(1000, block_size=4)
    a = _prompt(16, 9)
    source = _kv(target, a)
    pc.store(a, source)
    before = [t.clone() for layer in pc._entries[0].layers for t in layer]
    source.layers[0].keys.zero_()  # the store kept a copy
    n, cache = pc.lookup(a[:12] + _prompt(6, 10))
    assert n == 12
    forward_logits(target, torch.tensor([_prompt(6, 10)]), cache)  # appending to the reused columns
    after = [t for layer in pc._entries[0].layers for t in layer]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def _decode(dec, prompts, **settings):
    rows = dec.add_many(
        [dict(prompt_ids=p, max_new_tokens=NEW, eos_token_id=[], **settings) for p in prompts]
    )
    while dec.rows:
        dec.step()
    return [r.generated for r in rows], [r.stats for r in rows]


@pytest.mark.parametrize("speculative", [False, True])
def test_decoding_with_the_prefix_cache_emits_what_it_emits_without(models, speculative):
    """Greedy rows: token-identical with and without stored prefixes, whether a prompt is found whole, by a shared
    block prefix, or not at all, admitted together or alone; a prompt found whole runs no prefill forward."""
    target, draft = models

    def make():
        if speculative:
            return BatchedSpeculativeDecoder(target, draft, "resispec", (2, 1))
        return BatchedDecoder(target)

    first = [_prompt(n, 20 + n) for n in (40, 9, 1, 23)]
    shared = [first[0][:35] + _prompt(8, 30), first[3][:17] + _prompt(3, 31), _prompt(18, 32)]
    greedy = dict(temperature=0.0)
    want_first, _ = _decode(make(), first, **greedy)
    want_shared, _ = _decode(make(), shared, **greedy)
    assert len({tuple(o) for o in want_first + want_shared}) > 3  # varied outputs: a meaningful identity test

    dec = make()
    dec.enable_prefix_cache(4096)
    assert _decode(dec, first, **greedy)[0] == want_first
    got, stats = _decode(dec, first, **greedy)  # all four seen before
    assert got == want_first
    assert [s.cached_prompt_tokens for s in stats] == [
        39,
        8,
        0,
        22,
    ]  # all but the last token; a 1-token prompt: 0
    if not speculative:  # one forward a token, none for the prefill
        assert [s.target_forwards for s in stats] == [NEW] * 4
    got, stats = _decode(dec, shared, **greedy)  # block prefixes of two of them
    assert got == want_shared
    assert [s.cached_prompt_tokens for s in stats] == [32, 16, 0]
    if not speculative:  # the rest of a prompt found by its blocks is prefilled
        assert [s.target_forwards for s in stats] == [NEW + 1] * 3
    for p in shared:  # and one at a time, after rows came and went
        assert _decode(dec, [p], **greedy)[0] == [want_shared[shared.index(p)]]
    if speculative:
        assert dec.draft_prefix is not None and dec.draft_prefix.hits > 0
    dec.enable_prefix_cache(0)
    assert dec.prefix is None and _decode(dec, first, **greedy)[1][0].cached_prompt_tokens == 0


@pytest.mark.parametrize("speculative", [False, True])
def test_a_finished_row_is_stored_for_the_next_turn(models, speculative):
    """A finished row leaves its prompt and generated tokens' K/V behind (the tokens the cache held: all but the
    last): equal to a fresh prefill of them, and a next turn that repeats the conversation reuses its whole blocks
    and decodes what it decodes without the cache."""
    target, draft = models

    def make():
        if speculative:
            return BatchedSpeculativeDecoder(target, draft, "resispec", (2, 1))
        return BatchedDecoder(target)

    first = [_prompt(21, 40), _prompt(9, 41)]
    dec = make()
    dec.enable_prefix_cache(4096)
    sampled = dict(temperature=1.0, generator=torch.Generator().manual_seed(0))  # rejections leave holes
    outs, _ = _decode(dec, first, **sampled)
    for p, out in zip(first, outs, strict=True):
        seq = p + out[:-1]
        n, cache = dec.prefix.lookup(seq)
        assert n == len(seq)
        fresh = _kv(target, seq)
        for mine, ref in zip(cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-4)
    turn2 = [first[0] + outs[0] + _prompt(5, 42), first[1] + outs[1] + _prompt(12, 43)]
    want, _ = _decode(make(), turn2, temperature=0.0)
    got, stats = _decode(dec, turn2, temperature=0.0)
    assert got == want
    assert [s.cached_prompt_tokens for s in stats] == [
        (len(first[b]) + len(outs[b]) - 1) // 16 * 16 for b in range(2)
    ]


def test_an_older_entry_answers_when_a_newer_one_sharing_its_prefix_is_evicted(models):
    """A prompt's entry, then a longer one holding its blocks (a finished row of that prompt): storing the prompt
    again finds its own entry (no duplicate), and evicting the longer one leaves the prompt's blocks findable."""
    target, _ = models
    pc = PrefixCache(1000, block_size=4)
    a = _prompt(12, 50)
    longer = a + _prompt(8, 51)
    pc.store(a, _kv(target, a))
    pc.store(longer, _kv(target, longer))
    pc.store(a, _kv(target, a))  # held already: only marked as used, so `longer` is now the oldest
    assert (len(pc), pc.num_tokens) == (2, 32)
    pc.max_tokens = 40
    pc.store(_prompt(16, 52), _kv(target, _prompt(16, 52)))  # 48 > 40: `longer` goes
    assert len(pc) == 2 and pc.lookup(longer)[0] == 12  # a's entry still answers for a's blocks
    assert pc._index.keys() == {k for e in pc._entries.values() for k in e.keys}  # no key of an evicted entry


@pytest.mark.parametrize("speculative", [False, True])
def test_a_prompt_prefilled_in_parts_decodes_as_one_prefilled_at_once(models, speculative):
    """Chunked prefill (prefill_part): a row that joins after its prompt was prefilled in parts, of any size, emits
    the greedy tokens of a row prefilled at once, beside a running row; its parts' caches hold what one prefill
    computes; the first part starts after the longest prefix every model has stored, and the stats count the
    parts' forwards and the cached tokens."""
    target, draft = models

    def make():
        if speculative:
            return BatchedSpeculativeDecoder(target, draft, "resispec", (2, 1))
        return BatchedDecoder(target)

    greedy = dict(max_new_tokens=NEW, eos_token_id=[], temperature=0.0)
    long, other = _prompt(45, 50), _prompt(12, 51)
    want = _decode(make(), [other, long], temperature=0.0)[0]
    for size in (1, 7, 16, 44, 100):
        dec = make()
        running = dec.add(other, **greedy)
        dec.step()
        part = None
        while part is None or part.remaining:
            part = dec.prefill_part(long, size, part)
            dec.step()  # the running row goes on between the parts
        assert part.done == 44 and part.cached == 0
        for kind, model in [("target", target)] + [("draft", draft)] * speculative:
            ref = _kv(model, long[:-1])
            for mine, full in zip(part.caches[kind].layers, ref.layers, strict=True):
                torch.testing.assert_close(mine.keys, full.keys, atol=1e-5, rtol=1e-4)
        row = dec.add_many([dict(prompt_ids=long, partial=part, **greedy)])[0]
        assert row.partial is None and row.stats.target_forwards == -(-44 // size)
        while dec.rows:
            dec.step()
        assert running.generated == want[0] and row.generated == want[1], size
    # with stored prefixes: the first part starts after them, and the row's stats count them as cached
    dec = make()
    dec.enable_prefix_cache(4096)
    _decode(dec, [long[:33] + [1, 2, 3]], temperature=0.0)
    part = dec.prefill_part(long, 4)
    assert (part.cached, part.done) == (32, 36)
    part = dec.prefill_part(long, 100, part)
    row = dec.add_many([dict(prompt_ids=long, partial=part, **greedy)])[0]
    while dec.rows:
        dec.step()
    assert row.generated == want[1] and row.stats.cached_prompt_tokens == 32
    assert dec.prefix.lookup(long[:-1])[0] == 44  # and the whole prompt is stored as it joins
    with pytest.raises(ValueError, match="another prompt"):
        dec.add_many([dict(prompt_ids=other, partial=part, **greedy)])
