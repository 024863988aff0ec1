"""Batched decoding, autoregressive (BatchedDecoder) and speculative (BatchedSpeculativeDecoder): every row of a batch
equals decoding it alone (greedy: also HF generate, every rule and tree shape), rows join and leave at step
boundaries, a seeded sampled row gives the same tokens whatever its neighbours, memory stays bounded, and a sampled
row inside a mixed batch follows the target's joint law."""

from __future__ import annotations

import pytest
import torch

from resispec.decoding import SpeculativeDecoder
from resispec.decoding.batch import BatchedDecoder, BatchedSpeculativeDecoder
from resispec.verify import VERIFIERS
from tests.unit.test_decoding_helpers import micro_llama, one_thread_per_module  # noqa: F401 (autouse fixture)

VOCAB = 64
NEW = 24
LENGTHS = (1, 5, 12, 3, 20)


@pytest.fixture(scope="module")
def setup():
    target = micro_llama(64, 2, VOCAB, seed=0, attention_gain=(8.0, 4.0))  # positions and masks count
    dec = SpeculativeDecoder(target, target, rule="chain", tree=[1])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    return target, dec, prompts


def _alone(dec, prompt, new=NEW, **settings):
    out = dec.generate_autoregressive(torch.tensor([prompt]), max_new_tokens=new, eos_token_id=[], **settings)
    return out.sequences[0, len(prompt) :].tolist()


def _hf_greedy(target, prompt, new=NEW):
    """HF generate(do_sample=False): the reference for greedy rows. The mask is all ones: token 0 is a prompt token
    here, and HF would otherwise take it for padding (pad_token_id=0) and mask it."""
    ids = torch.tensor([prompt])
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_rows_equal_alone_and_hf_generate(setup):
    target, dec, prompts = setup
    out = BatchedDecoder.from_decoder(dec).generate(
        prompts, dict(max_new_tokens=NEW, temperature=0.0, eos_token_id=[])
    )
    for prompt, got in zip(prompts, out, strict=True):
        assert got == _alone(dec, prompt, temperature=0.0)
        assert got == _hf_greedy(target, prompt)
    assert len({tuple(o) for o in out}) > 1  # varied outputs: a meaningful identity test


def test_rows_join_and_leave_at_step_boundaries(setup):
    _, dec, prompts = setup
    bd = BatchedDecoder.from_decoder(dec)
    rows, peak = [], 0
    for i, prompt in enumerate(
        prompts
    ):  # a newcomer every two steps; different max tokens, so rows leave apart
        rows.append(bd.add(prompt, max_new_tokens=8 + 3 * i, temperature=0.0, eos_token_id=[]))
        for _ in range(2):
            bd.step()
            peak = max(peak, bd.num_cols)
    cancelled = rows[1]
    bd.remove(cancelled)
    while bd.rows:
        bd.step()
        # bounded memory: the cache is never wider than the longest running row
        assert bd.num_cols == max((r.length for r in bd.rows), default=0)
    for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        if row is cancelled:
            continue
        assert len(row.generated) == 8 + 3 * i
        assert row.generated == _alone(dec, prompt, new=8 + 3 * i, temperature=0.0)
    assert bd.num_cols == 0 and bd.kv_tokens == 0


def test_seeded_row_ignores_its_neighbours(setup):
    _, dec, prompts = setup
    bd = BatchedDecoder.from_decoder(dec)
    settings = dict(max_new_tokens=NEW, temperature=1.0, top_k=20, top_p=0.9, eos_token_id=[])

    def run(neighbours):
        row = bd.add(prompts[2], generator=torch.Generator().manual_seed(7), **settings)
        for j, p in enumerate(neighbours):  # greedy and sampled neighbours with other settings and seeds
            temp = 0.0 if j % 2 else 0.7
            bd.add(p, max_new_tokens=5 + j, temperature=temp, generator=torch.Generator().manual_seed(j))
        while bd.rows:
            bd.step()
        return row.generated

    ref = _alone(
        dec,
        prompts[2],
        generator=torch.Generator().manual_seed(7),
        **{k: v for k, v in settings.items() if k not in ("max_new_tokens", "eos_token_id")},
    )
    assert run([]) == ref
    assert run(prompts[:2]) == ref
    assert run(prompts[3:] + prompts[:1]) == ref


def test_stops_per_row(setup):
    _, dec, prompts = setup
    bd = BatchedDecoder.from_decoder(dec)
    free = _alone(dec, prompts[1], temperature=0.0)
    eos = free[5]
    rows = [
        bd.add(prompts[1], max_new_tokens=NEW, temperature=0.0, eos_token_id=eos),
        bd.add(prompts[1], max_new_tokens=NEW, temperature=0.0, stop_checker=lambda ids: len(ids) >= 3),
        bd.add(prompts[1], max_new_tokens=0, temperature=0.0),
    ]
    while bd.rows:
        bd.step()
    assert rows[0].generated == free[: free.index(eos) + 1]
    assert rows[1].generated == free[:3]
    assert rows[2].generated == [] and rows[2].finished


# ---------------------------------------------------------------------------- batched speculative decoding
def _spec(setup, rule="resispec", tree=(3, 2, 1), **kwargs):
    from tests.unit.test_decoding_helpers import noisy_copy

    target = setup[0]
    draft = noisy_copy(target, 0.3, seed=1)
    dec = SpeculativeDecoder(target, draft, rule=rule, tree=list(tree), **kwargs)
    return dec, BatchedSpeculativeDecoder.from_decoder(dec)


@pytest.mark.parametrize("tree", [(1,), (1, 1, 1), (3, 2, 1), (4, 1)])
def test_batched_spec_greedy_rows_equal_alone_and_hf(setup, tree):
    target, ar, prompts = setup
    dec, bs = _spec(setup, tree=tree)
    out = bs.generate(prompts, dict(max_new_tokens=NEW, temperature=0.0, eos_token_id=[]))
    for prompt, got in zip(prompts, out, strict=True):
        assert got == _alone(ar, prompt, temperature=0.0)
        assert got == _hf_greedy(target, prompt)
    assert bs.tcache.num_cols == 0 and bs.dcache.num_cols == 0  # everything released


@pytest.mark.parametrize("prefill_draft", [True, False])
@pytest.mark.parametrize("tree", [(1, 1, 1), (2, 2, 1)])
def test_batched_spec_target_as_its_own_draft_accepts_every_level(setup, tree, prefill_draft):
    """The target drafting for itself, greedy: every level of every row's tree is accepted (the walk only stops at
    the leaf, or where max_new_tokens cuts the tree). Exactness cannot see the draft's side of a step (a draft
    that attends to the wrong nodes only lowers acceptance); this can: the draft's per-row masks over the
    earlier levels (a node sees its ancestors; tried: dropping them fails this test), and the draft cache of a
    newcomer, prefilled alone when it joins (prefill_draft) or fed its prompt as the left-padded pending block of
    a running batch's drafting step. Positions off by one go unnoticed on this random model: RoPE shifts matter
    little to it."""
    _, _, prompts = setup
    target = micro_llama(64, 2, VOCAB, seed=4)
    # attention that matters: a bigram-like random model would not notice a missing parent
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.v_proj.weight.mul_(4.0)
            layer.self_attn.o_proj.weight.mul_(4.0)
    dec = SpeculativeDecoder(target, target, rule="resispec", tree=list(tree))
    bs = BatchedSpeculativeDecoder.from_decoder(dec)
    bs.prefill_draft = prefill_draft
    rows = [bs.add(p, max_new_tokens=NEW, temperature=0.0, eos_token_id=[]) for p in prompts[:3]]
    for _ in range(2):
        bs.step()
    # newcomers join a running batch: prefilled alone, or their prompts are the pending block of the next step
    rows += [bs.add(p, max_new_tokens=NEW, temperature=0.0, eos_token_id=[]) for p in prompts[3:]]
    assert [len(r.pending) for r in rows[3:]] == ([1, 1] if prefill_draft else [len(p) for p in prompts[3:]])
    while bs.rows:
        bs.step()
    for row in rows:
        s = row.stats
        assert s.num_drafts > 0
        # every step but the last (cut by max_new_tokens) accepts all len(tree) levels
        assert s.num_accepted_tokens >= len(tree) * (s.num_drafts - 1), (s.num_accepted_tokens, s.num_drafts)


@pytest.mark.parametrize("rule", sorted(VERIFIERS))
def test_batched_spec_greedy_every_rule(setup, rule):
    """The rule itself on one-hot p and q (greedy_topk=False), a branching tree."""
    _, ar, prompts = setup
    _, bs = _spec(setup, rule=rule, tree=(2, 2, 1), greedy_topk=False)
    out = bs.generate(prompts[1:4], dict(max_new_tokens=16, temperature=0.0, eos_token_id=[]))
    for prompt, got in zip(prompts[1:4], out, strict=True):
        assert got == _alone(ar, prompt, new=16, temperature=0.0)


def test_batched_spec_seeded_row_equals_alone_whatever_the_neighbours(setup):
    _, _, prompts = setup
    dec, bs = _spec(setup, rule="resispec", tree=(3, 2, 1))
    settings = dict(temperature=1.0, top_k=20, top_p=0.95, eos_token_id=[])
    ref = dec.generate(
        torch.tensor([prompts[2]]), max_new_tokens=NEW, generator=torch.Generator().manual_seed(7), **settings
    )
    ref = ref.sequences[0, len(prompts[2]) :].tolist()

    def run(neighbours):
        row = bs.add(prompts[2], max_new_tokens=NEW, generator=torch.Generator().manual_seed(7), **settings)
        for j, p in enumerate(neighbours):
            temp = 0.0 if j % 2 else 0.7
            bs.add(p, max_new_tokens=5 + 3 * j, temperature=temp, generator=torch.Generator().manual_seed(j))
        while bs.rows:
            bs.step()
        return row

    assert run([]).generated == ref
    assert run(prompts[:2]).generated == ref
    row = run(prompts[3:] + prompts[:1])
    assert row.generated == ref and row.stats.tau > 1.0


@pytest.mark.parametrize("tree", [(1,), (1, 1, 1)])
@pytest.mark.parametrize("rule", ["chain", "rrs", "kseq", "resispec"])
def test_batched_spec_chain_rows_equal_alone_whatever_the_neighbours(setup, rule, tree):
    """Sampled rows drafting a chain of one-draw nodes are drafted and verified for the whole batch at once
    (walk_one_draw_chains); each row still draws its own generator's numbers in the order it does alone, so every
    such row (own temperature, top-k, top-p; chains cut short by max_new_tokens near the end) gives the tokens of
    the batch-1 decoder with the same seed, next to a greedy neighbour and a seeded (SeedStream) one that drafts a
    tree or nothing."""
    from resispec.sampling import SeedStream

    _, _, prompts = setup
    dec, bs = _spec(setup, rule=rule, tree=tree)
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20, top_p=0.9),
        dict(temperature=1.3, top_p=0.8),
    ]

    def alone(i, s):
        gen = torch.Generator().manual_seed(40 + i)
        out = dec.generate(
            torch.tensor([prompts[i]]), max_new_tokens=NEW - i, generator=gen, eos_token_id=[], **s
        )
        return out.sequences[0, len(prompts[i]) :].tolist()

    rows = [
        bs.add(
            prompts[i],
            max_new_tokens=NEW - i,
            generator=torch.Generator().manual_seed(40 + i),
            eos_token_id=[],
            **s,
        )
        for i, s in enumerate(settings)
    ]
    bs.add(prompts[3], max_new_tokens=NEW, temperature=0.0, eos_token_id=[])
    bs.add(prompts[4], max_new_tokens=NEW, temperature=1.0, eos_token_id=[], generator=SeedStream(3))
    for step in range(10 * NEW):
        if not bs.rows:
            break
        # the observed rows draft the decoder's chain; the seeded neighbour drafts a tree, or nothing
        bs.step([True if r in rows else (2, 1) if step % 3 else False for r in bs.rows])
    for i, (row, s) in enumerate(zip(rows, settings, strict=True)):
        assert row.generated == alone(i, s), (rule, tree, s)
    assert any(r.stats.tau > 1.0 for r in rows)


def test_batched_spec_rows_join_and_leave_with_bounded_cache(setup):
    _, ar, prompts = setup
    _, bs = _spec(setup, tree=(3, 2, 1))
    rows = []
    for i, prompt in enumerate(prompts * 2):  # a newcomer every step
        rows.append(bs.add(prompt, max_new_tokens=6 + 2 * i, temperature=0.0, eos_token_id=[]))
        bs.step()
    bs.remove(rows[3])
    while bs.rows:
        bs.step()
        longest = max((r.length for r in bs.rows), default=0)
        # holes are cropped or repacked: never more than about twice the longest row, plus one step's tree
        assert bs.tcache.num_cols <= 2 * longest + 16 + bs.max_nodes + 1
    for i, (row, prompt) in enumerate(zip(rows, prompts * 2, strict=True)):
        if i != 3:
            assert row.generated == _alone(ar, prompt, new=6 + 2 * i, temperature=0.0)


@pytest.mark.parametrize("rule", sorted(n for n, r in VERIFIERS.items() if not r.greedy_only))
def test_batched_spec_joint_law_inside_a_mixed_batch(rule):
    """The batch-1 joint-law test (test_decoding_exactness) for rows decoded in batches of 10 observed rows plus a
    greedy and a cooler neighbour with longer prompts."""
    from tests.unit import test_decoding_exactness as ex
    from tests.unit.test_decoding_helpers import mixed_batch_joint_counts, noisy_copy

    # attending, as test_decoding_exactness's world: a position off by one moves the law (~1e-4 TV without it)
    target = micro_llama(32, 1, ex.VOCAB, seed=0, scale=24.0, attention_gain=(8.0, 4.0))
    draft = noisy_copy(target, 0.6, seed=1)
    joint = ex.exact_joint(target)
    num = 300
    crit = ex.powered_critical_value(joint, ex.exact_joint(draft), num)
    bs = BatchedSpeculativeDecoder(target, draft, rule=rule, tree=ex.TREE)
    seed = 1000 * sorted(VERIFIERS).index(rule)
    counts = mixed_batch_joint_counts(bs, ex.PROMPT[0], ex.VOCAB, num, seed, ex.SETTINGS)
    stat, df = ex.pearson(counts.reshape(ex.VOCAB, ex.VOCAB, ex.VOCAB), joint, num)
    assert stat < crit, f"{rule}: X^2 = {stat:.1f} >= {crit:.1f} (df {df}) inside a mixed batch"


def test_batched_spec_switches_speculation_off_and_on_between_steps(setup):
    _, ar, prompts = setup
    _, bs = _spec(setup, tree=(3, 2, 1))
    rows = [bs.add(p, max_new_tokens=NEW, temperature=0.0, eos_token_id=[]) for p in prompts]
    step = 0
    while bs.rows:
        if step % 2:  # per-row flags: some rows draft, others take an AR step
            bs.step(draft=[(step + b) % 3 != 1 for b in range(len(bs.rows))])
        else:  # every row AR every third step: no draft forward, the draft catches up later
            bs.step(draft=step % 3 != 1)
        step += 1
    for row, prompt in zip(rows, prompts, strict=True):
        assert row.generated == _alone(ar, prompt, temperature=0.0)
        assert row.stats.num_drafts < row.stats.target_forwards - 1  # some steps were autoregressive


def test_batched_spec_draft_cache_emptied_by_a_leaving_row(setup):
    """The only row with draft-cache tokens leaves while the others have not drafted yet: the emptied cache must
    take the next rows at their batch size."""
    _, ar, prompts = setup
    _, bs = _spec(setup, tree=(2, 1))
    first = bs.add(prompts[1], max_new_tokens=NEW, temperature=0.0, eos_token_id=[])
    bs.step()
    rows = [bs.add(p, max_new_tokens=NEW, temperature=0.0, eos_token_id=[]) for p in prompts[2:4]]
    bs.remove(first)
    rows.append(bs.add(prompts[4], max_new_tokens=NEW, temperature=0.0, eos_token_id=[]))
    while bs.rows:
        bs.step(draft=len(bs.rows) < 3)
    for row, prompt in zip(rows, prompts[2:5], strict=True):
        assert row.generated == _alone(ar, prompt, temperature=0.0)


def test_batched_spec_changes_its_tree_between_steps(setup):
    """The scheduler's per-batch-size trees: each step may draft another tree (deeper or wider than the decoder's
    own, per row or for all), or none; every step is an exact step of its tree, so greedy rows stay the target's."""
    _, ar, prompts = setup
    _, bs = _spec(setup, tree=(2, 1))
    rows = [bs.add(p, max_new_tokens=NEW, temperature=0.0, eos_token_id=[]) for p in prompts]
    schedule = [(3, 2, 1, 1), True, False, (1, 1, 1, 1, 1), (4,)]
    step = 0
    while bs.rows:
        if step % 3 == 2:  # per-row trees in one step
            bs.step(draft=[schedule[(step + b) % len(schedule)] for b in range(len(bs.rows))])
        else:
            bs.step(draft=schedule[step % len(schedule)])
        step += 1
    for row, prompt in zip(rows, prompts, strict=True):
        assert row.generated == _alone(ar, prompt, temperature=0.0)
        # depths up to 5 were drafted although the decoder's own tree has 2
        assert len(row.stats.reached_per_position) == 5
        assert row.stats.reached_per_position[0] >= row.stats.reached_per_position[4]


def test_batched_spec_tree_per_step_is_the_tree_alone(setup):
    """Drafting tree X for a row inside the batch is the batch-1 decoder with tree X: same seed, same tokens."""
    _, _, prompts = setup
    dec, bs = _spec(setup, rule="resispec", tree=(2, 1))
    settings = dict(temperature=1.0, top_k=0, top_p=1.0, eos_token_id=[])
    other, _ = _spec(setup, rule="resispec", tree=(3, 1, 1))
    alone = other.generate(
        torch.tensor([prompts[2]]), max_new_tokens=NEW, generator=torch.Generator().manual_seed(7), **settings
    ).sequences[0, len(prompts[2]) :]
    row = bs.add(prompts[2], max_new_tokens=NEW, generator=torch.Generator().manual_seed(7), **settings)
    bs.add(prompts[0], max_new_tokens=NEW // 2, temperature=0.0, eos_token_id=[])
    while bs.rows:
        bs.step(draft=[(3, 1, 1) if r is row else False for r in bs.rows])
    assert row.generated == alone.tolist()


def test_batched_spec_steps_without_a_draft_are_batched_ar(setup):
    """A step in which no row drafts takes the autoregressive fast path on the holey cache: every row, sampled
    ones included, draws the token BatchedDecoder draws with the same seed, before and after drafting steps left
    holes (rejected nodes) in the cache; and the draft catches up with the tokens it did not see. The target's
    attention is peaked so that a wrong position id or mask changes its tokens."""
    from tests.unit.test_decoding_helpers import noisy_copy

    _, _, prompts = setup
    target = micro_llama(64, 2, VOCAB, seed=0, attention_gain=(8.0, 4.0))
    dec = SpeculativeDecoder(target, target, rule="chain", tree=[1])
    bs = BatchedSpeculativeDecoder.from_decoder(
        SpeculativeDecoder(target, noisy_copy(target, 0.3, seed=1), rule="resispec", tree=[3, 1])
    )
    bd = BatchedDecoder.from_decoder(dec)
    settings = [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=20, top_p=0.9),
        dict(temperature=0.7),
        dict(temperature=1.0),
    ]
    for dest in (bs, bd):
        for i, s in enumerate(settings):
            gen = torch.Generator().manual_seed(11 + i)
            dest.add(prompts[i + 1], max_new_tokens=3 * NEW, eos_token_id=[], generator=gen, **s)
    for _ in range(NEW):  # AR from the start: the two decoders agree token for token
        got, want = bs.step(False), bd.step()
        assert [t for _, t in got] == [t for _, t in want]
    for _ in range(6):  # drafting steps leave holes in the spec batch's cache
        bs.step(True)
    assert bs.tcache.num_cols > max(int(n) for n in bs.tcache.valid.sum(1))
    lone = BatchedDecoder.from_decoder(
        dec
    )  # each row's text so far, decoded on by batched AR from a fresh seed
    for r in bs.rows:
        r.generator = torch.Generator().manual_seed(5)
        seed = torch.Generator().manual_seed(5)
        lone.add(r.prompt + r.generated, max_new_tokens=NEW, eos_token_id=[], generator=seed, **r.settings)
    for _ in range(NEW // 2):
        got, want = bs.step(False), lone.step()
        assert [t for _, t in got] == [t for _, t in want]
    greedy = bs.rows[0]
    assert greedy.greedy
    while bs.rows:  # drafting again: the draft is fed the tokens it missed, and the greedy row stays exact
        bs.step(True)
    assert greedy.generated == _alone(dec, greedy.prompt, new=3 * NEW, temperature=0.0)
    assert bs.tcache.num_cols == 0


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("lengths", ["mixed", "equal"])
def test_rows_prefilled_together_equal_rows_added_one_by_one(setup, speculative, lengths):
    """add_many prefills all newcomers in ONE forward (left-padded and masked where the prompts' lengths differ, a
    1-token prompt among them): each row's cache holds what its own prefill would (within float error), and every
    row then decodes as it would alone: greedy rows their greedy tokens, a seeded sampled row the same tokens."""
    from resispec.decoding.batch_rows import prefill_caches

    target, ar, prompts = setup
    if lengths == "equal":
        prompts = [(p * 20)[:9] for p in prompts]
    dec, bs = _spec(setup, tree=(2, 1)) if speculative else (ar, BatchedDecoder.from_decoder(ar))
    settings = [dict(temperature=0.0, eos_token_id=[], max_new_tokens=NEW) for _ in prompts]
    settings[1] = dict(temperature=1.0, top_k=20, eos_token_id=[], max_new_tokens=NEW)

    def seeded(s):
        return dict(s, generator=torch.Generator().manual_seed(3))

    # the caches: together against one by one, on the decoder's forward and on the HF forward (4D additive mask)
    for forward in (bs._target_fwd, target):
        rows = [bs._new_row(p, **s) for p, s in zip(prompts, settings, strict=True)]
        together = prefill_caches(forward, target, rows, "target")
        for row, cache in zip(rows, together, strict=True):
            (alone,) = prefill_caches(bs._target_fwd, target, [row], "target")
            if len(row.prompt) == 1:
                assert cache.get_seq_length() == 0
                continue
            for a, b in zip(alone.layers, cache.layers, strict=True):
                assert (
                    b.keys.shape
                    == a.keys.shape
                    == (1, a.keys.shape[1], len(row.prompt) - 1, a.keys.shape[-1])
                )
                torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(b.values, a.values, rtol=1e-4, atol=1e-5)
        assert sum(r.stats.target_forwards for r in rows) == 2 * sum(len(p) > 1 for p in prompts)

    def one_by_one():
        rows = [bs.add(p, **seeded(s)) for p, s in zip(prompts, settings, strict=True)]
        while bs.rows:
            bs.step()
        return [r.generated for r in rows]

    got = bs.generate(prompts, [seeded(s) for s in settings])
    assert got == one_by_one()
    for b, (prompt, out) in enumerate(zip(prompts, got, strict=True)):
        if b != 1:
            assert out == _alone(ar, prompt, temperature=0.0)
    if speculative:  # the seeded sampled row equals the batch-1 speculative decoder's tokens for that seed
        ref = dec.generate(torch.tensor([prompts[1]]), **seeded(settings[1]))
        assert got[1] == ref.sequences[0, len(prompts[1]) :].tolist()


def test_add_many_checks_every_row_first(setup):
    _, ar, prompts = setup
    bd = BatchedDecoder.from_decoder(ar)
    with pytest.raises(ValueError, match="empty prompt"):
        bd.add_many([dict(prompt_ids=prompts[0]), dict(prompt_ids=[])])
    assert bd.rows == [] and bd.num_cols == 0
    rows = bd.add_many([dict(prompt_ids=prompts[2], max_new_tokens=0), dict(prompt_ids=prompts[3])])
    assert rows[0].finished and bd.rows == [rows[1]]


def test_batched_spec_in_lockstep(setup):
    """`in_lockstep` (the scheduler holds drafting probes back while it holds): equal prompts admitted together stay
    in lockstep under AR steps, and so does one that joins a step later; a drafting step whose rows accept
    different numbers of tokens, or rows of different lengths, are not in lockstep."""
    _, _, prompts = setup
    _, bs = _spec(setup, tree=(2, 1))
    equal = [(p * 20)[:9] for p in prompts]
    greedy = dict(max_new_tokens=NEW, temperature=0.0, eos_token_id=[])
    bs.add_many([dict(greedy, prompt_ids=p) for p in equal[:-1]])
    assert bs.in_lockstep
    bs.step(False)
    bs.add(equal[-1], **greedy)  # a step late
    for _ in range(3):
        assert bs.in_lockstep
        bs.step(False)
    while bs.in_lockstep and bs.rows:  # drafting: some row accepts fewer than another sooner or later
        bs.step(True)
    assert bs.rows and not bs.in_lockstep
    bs.reset()
    bs.add_many([dict(greedy, prompt_ids=p) for p in prompts])
    assert not bs.in_lockstep
