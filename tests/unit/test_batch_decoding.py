"""BatchedDecoder: every row of a batch equals decoding it alone (greedy: also HF generate), rows join and leave at
step boundaries, a seeded sampled row gives the same tokens whatever its neighbours, memory stays bounded."""

from __future__ import annotations

import pytest
import torch

from resispec.decoding import SpeculativeDecoder
from resispec.decoding.batch import BatchedDecoder
from tests.unit.test_decoding_helpers import micro_llama, single_thread

VOCAB = 64
NEW = 24
LENGTHS = (1, 5, 12, 3, 20)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def setup():
    target = micro_llama(64, 2, VOCAB, seed=0)
    dec = SpeculativeDecoder(target, target, rule="chain", tree=[1])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    return target, dec, prompts


def _alone(dec, prompt, new=NEW, **settings):
    out = dec.generate_autoregressive(torch.tensor([prompt]), max_new_tokens=new, eos_token_id=[], **settings)
    return out.sequences[0, len(prompt) :].tolist()


def test_greedy_rows_equal_alone_and_hf_generate(setup):
    target, dec, prompts = setup
    out = BatchedDecoder.from_decoder(dec).generate(
        prompts, dict(max_new_tokens=NEW, temperature=0.0, eos_token_id=[])
    )
    for prompt, got in zip(prompts, out, strict=True):
        assert got == _alone(dec, prompt, temperature=0.0)
        hf = target.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert got == hf[0, len(prompt) :].tolist()
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
