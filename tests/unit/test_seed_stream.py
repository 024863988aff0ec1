"""Seeded requests (resispec.sampling.SeedStream): the token at each position is argmax(log p + G), with Gumbel noise
keyed by (seed, position). So a seeded sequence is the same whether it was decoded autoregressively, speculatively
with any tree (the decoder's step or the reference step, tests/oracle_decoder.py), alone, or as a row of a batch
whose rows draft or not step by step; and it still follows the target's law (the joint-law test of
tests/unit/test_decoding_exactness.py, over seeds)."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chi2

from resispec.decoding import SpeculativeDecoder
from resispec.decoding.batch import BatchedDecoder, BatchedSpeculativeDecoder
from resispec.sampling import SeedStream
from tests.oracle_decoder import ReferenceDecoder, decoder
from tests.unit import test_decoding_exactness as ex
from tests.unit.test_decoding_helpers import micro_llama, noisy_copy, one_thread_per_module  # noqa: F401 (autouse fixture)

VOCAB = 64
NEW = 20
SETTINGS = dict(temperature=1.0, top_k=0, top_p=0.95)


@pytest.fixture(scope="module")
def pair():
    target = micro_llama(64, 2, VOCAB, seed=0, scale=8.0, attention_gain=(8.0, 4.0))
    draft = noisy_copy(target, 0.5, seed=1)  # close enough to accept often, far enough to reject often
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 12, 3)]
    return target, draft, prompts


def test_seed_stream_noise_is_keyed_by_seed_and_position():
    like = torch.zeros(1, 1000)
    s = SeedStream(3)
    assert torch.equal(s.gumbel(7, like), SeedStream(3).gumbel(7, like))
    assert not torch.equal(s.gumbel(7, like), s.gumbel(8, like))
    assert not torch.equal(s.gumbel(7, like), SeedStream(4).gumbel(7, like))
    # a draw at one position is a draw from p: 20k seeds against a fixed p
    p = torch.tensor([[0.5, 0.25, 0.15, 0.1]])
    counts = torch.bincount(
        torch.stack([SeedStream(i).sample(p, 5) for i in range(20000)]).flatten(), minlength=4
    )
    stat = float(((counts - 20000 * p[0]) ** 2 / (20000 * p[0])).sum())
    assert stat < chi2.ppf(1 - 1e-4, 3), counts


def test_a_seeded_sequence_is_the_same_in_every_mode(pair):
    target, draft, prompts = pair
    prompt, seeds = prompts[2], range(4)
    ar = SpeculativeDecoder(target, draft, rule="resispec", tree=[1])

    def alone(dec, seed):
        out = dec.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            eos_token_id=[],
            generator=SeedStream(seed),
            **SETTINGS,
        )
        return out.sequences[0, len(prompt) :].tolist(), dec.last_stats

    refs = {}
    for seed in seeds:
        out = ar.generate_autoregressive(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            eos_token_id=[],
            generator=SeedStream(seed),
            **SETTINGS,
        )
        refs[seed] = out.sequences[0, len(prompt) :].tolist()
    assert len({tuple(r) for r in refs.values()}) == len(refs)  # the seed matters
    taus = []
    for rule, tree, lean in (
        ("resispec", [2, 2, 1], True),
        ("rrs", [1, 1, 1], False),
        ("chain", [3, 1], True),
    ):
        dec = decoder(target, draft, not lean, rule=rule, tree=tree)
        for seed in seeds:
            got, stats = alone(dec, seed)
            assert got == refs[seed], (rule, tree, lean, seed)
            taus.append(stats.tau)
    # meaningful: drafts were accepted and rejected
    assert 1.2 < sum(taus) / len(taus) < 3.0, taus
    # a plain generator follows the rule's own stream: a different sequence from the same seed
    plain = SpeculativeDecoder(target, draft, rule="resispec", tree=[2, 2, 1]).generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
        **SETTINGS,
    )
    assert plain.sequences[0, len(prompt) :].tolist() != refs[0]

    # batch rows with neighbours, each step drafting a random tree or none; and the batched AR decoder
    rng = random.Random(0)
    bs = BatchedSpeculativeDecoder(target, draft, rule="resispec", tree=[2, 1])
    bd = BatchedDecoder(target)
    for dec in (bs, bd):
        rows = {}
        for seed in seeds:
            rows[seed] = dec.add(
                prompt, max_new_tokens=NEW, eos_token_id=[], generator=SeedStream(seed), **SETTINGS
            )
            for j, p in enumerate(prompts):
                temp = 0.0 if j % 2 else 0.7
                dec.add(
                    p,
                    max_new_tokens=4 + 3 * j,
                    temperature=temp,
                    generator=SeedStream(100 + j),
                    eos_token_id=[],
                )
        while dec.rows:
            if dec is bs:
                dec.step([rng.choice([False, True, (1,), (3, 1), (1, 1, 1)]) for _ in dec.rows])
            else:
                dec.step()
        for seed, row in rows.items():
            assert row.generated == refs[seed], (type(dec).__name__, seed)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "reference"])
def test_seeded_decoding_follows_the_target_law(lean):
    """The joint law of the first three tokens over 300 seeds (one sample each), the configured rule being
    resispec (seeded rows verify with gumbel): batch-1 lean and reference steps, and rows of a mixed batch."""
    # attending, as test_decoding_exactness's world: a position off by one moves the law (~1e-4 TV without it)
    target = micro_llama(32, 1, ex.VOCAB, seed=0, scale=24.0, attention_gain=(8.0, 4.0))
    draft = noisy_copy(target, 0.6, seed=1)
    joint = ex.exact_joint(target)
    num = 300
    crit = ex.powered_critical_value(joint, ex.exact_joint(draft), num)
    counts = torch.zeros(ex.VOCAB**3, dtype=torch.long)
    if lean:  # the batch-1 lean step, then rows of mixed batches (the batch's own walk)
        dec = SpeculativeDecoder(target, draft, rule="resispec", tree=ex.TREE)
        samples = [
            dec.generate(ex.PROMPT, max_new_tokens=3, eos_token_id=[], generator=SeedStream(s), **ex.SETTINGS)
            .sequences[0, 1:]
            .tolist()
            for s in range(num // 2)
        ]
        bs = BatchedSpeculativeDecoder(target, draft, rule="resispec", tree=ex.TREE)
        for start in range(num // 2, num, 10):
            rows = [
                bs.add(
                    ex.PROMPT[0], max_new_tokens=3, eos_token_id=[], generator=SeedStream(s), **ex.SETTINGS
                )
                for s in range(start, start + 10)
            ]
            bs.add([1, 2, 3, 4], max_new_tokens=5, temperature=0.0, eos_token_id=[])
            while bs.rows:
                bs.step()
            samples += [r.generated for r in rows]
    else:
        dec = ReferenceDecoder(target, draft, rule="resispec", tree=ex.TREE)
        samples = [
            dec.generate(ex.PROMPT, max_new_tokens=3, eos_token_id=[], generator=SeedStream(s), **ex.SETTINGS)
            .sequences[0, 1:]
            .tolist()
            for s in range(num)
        ]
    for a, b, c in samples:
        counts[(a * ex.VOCAB + b) * ex.VOCAB + c] += 1
    stat, df = ex.pearson(counts.reshape(ex.VOCAB, ex.VOCAB, ex.VOCAB), joint, num)
    assert stat < crit, (
        f"X^2 = {stat:.1f} >= {crit:.1f} (df {df}): seeded output law differs from the target's"
    )
