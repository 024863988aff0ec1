"""THE sampling transform (resispec/sampling.py): its filters, and the decoder's probability view held to the losses'
log-probability view on random logits for every top-k / top-p / temperature combination, ties included."""

from __future__ import annotations

import itertools

import pytest
import torch

from resispec.sampling import filter_logits, log_probs, probs

TEMPERATURES = (0.0, 0.3, 1.0, 1.7)
TOP_KS = (0, 1, 2, 5, 16, 17, 40)  # 16 = V (no cut), 40 > V
TOP_PS = (1.0, 0.95, 0.5, 0.1, 1e-6)  # top_p is in (0, 1] (serving/protocol.py)


def _logits(seed: int, ties: bool) -> torch.Tensor:
    """[6, 16] random logits; with `ties`, rounded to a coarse grid so the k-th logit and the nucleus edge tie."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 16, generator=gen) * 2.0
    if ties:
        logits = (logits * 2).round() / 2
        logits[0] = 0.0  # a fully flat row
        logits[1, :4] = logits[1].max()  # a 4-way tie at the top
    return logits


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_probability_view_equals_exp_of_log_view(ties: bool, temperature: float) -> None:
    logits = _logits(seed=int(temperature * 10) + 100 * ties, ties=ties)
    for top_k, top_p in itertools.product(TOP_KS, TOP_PS):
        pr = probs(logits, temperature, top_k, top_p)
        lp = log_probs(logits, temperature, top_k, top_p)
        assert pr.dtype == lp.dtype == torch.float32
        torch.testing.assert_close(pr.sum(-1), torch.ones(6))
        if temperature > 0:
            torch.testing.assert_close(pr, lp.exp(), atol=1e-6, rtol=1e-5)
            assert torch.equal(pr > 0, torch.isfinite(lp))  # the same tokens survive the filter
        else:
            # greedy: one-hot at the first argmax, which is the log view's (temperature 1) first argmax too
            assert torch.equal(pr.argmax(-1), logits.argmax(-1))
            assert torch.equal(pr.argmax(-1), lp.argmax(-1))
            assert torch.equal((pr == 1).sum(-1), torch.ones(6, dtype=torch.long))


def test_top_k_keeps_ties_and_top_p_keeps_one_token() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    assert (
        torch.isfinite(filter_logits(logits, top_k=2)).sum() == 3
    )  # the three-way tie at the 2nd value stays
    assert torch.isfinite(filter_logits(logits, top_p=1e-6)).sum() == 1  # nothing before the first token
    assert torch.isfinite(filter_logits(logits, top_k=1)).tolist() == [[False, True, True, False, True]]


def test_filters() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).sum() == 2
    p = logits.softmax(-1)[0]  # .64 .24 .09 .03 .01
    kept = torch.isfinite(filter_logits(logits, top_p=0.8)).sum().item()
    assert kept == 2 and p[:1].sum() < 0.8 <= p[:2].sum()
    # temperature 0 (greedy serving) trains at temperature 1
    torch.testing.assert_close(log_probs(logits, 0.0), logits.log_softmax(-1))
    torch.testing.assert_close(log_probs(logits, 0.5), (logits / 0.5).log_softmax(-1))


def test_probs_greedy_is_one_hot_first_argmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0]])
    assert probs(logits, temperature=0.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_probs_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    top_k = probs(logits, temperature=1.0, top_k=2)
    torch.testing.assert_close(top_k, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # top_p = 0.7: 0.5 < 0.7 so the second token is needed; 0.75 >= 0.7 so the third is dropped
    top_p = probs(logits, temperature=1.0, top_p=0.7)
    torch.testing.assert_close(top_p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    hot = probs(logits, temperature=0.5)
    torch.testing.assert_close(hot, torch.softmax(logits * 2, -1))


def test_sample_rows_draws_the_distribution_and_never_a_zero_weight_token() -> None:
    """The inverse-CDF sampler (the decoder's and the rules' one draw primitive): per-row frequencies of 40k draws
    match unnormalised weights within 5 standard errors, zero-weight tokens (first, inner, last) never come out,
    and a one-token row always draws it."""
    from resispec.sampling import sample_rows, sample_tokens

    weights = torch.tensor(
        [
            [0.0, 3.0, 0.0, 1.0, 0.5, 0.0],
            [2.0, 0.0, 0.0, 0.0, 0.0, 1e-3],
            [0.0, 0.0, 0.0, 0.0, 7.0, 0.0],
        ]
    )
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    draws = sample_rows(weights, n, gen)  # [3, n]
    assert draws.shape == (3, n)
    p = weights / weights.sum(-1, keepdim=True)
    freq = torch.stack([torch.bincount(d, minlength=6) for d in draws]).double() / n
    se = (p * (1 - p) / n).sqrt().double()
    assert ((freq - p).abs() <= 5 * se + 1e-12).all(), (freq, p)
    assert (freq[p == 0] == 0).all()
    assert sample_tokens(weights[2:] / 7.0, gen).tolist() == [4]


def test_standard_gumbel_law():
    """standard_gumbel (rsd/gumbel drafting, seeded rows): Kolmogorov-Smirnov against the Gumbel CDF
    exp(-exp(-x)), finite everywhere, the requested dtype; the same generator state gives the same noise."""
    from scipy import stats

    from resispec.sampling import standard_gumbel

    g = standard_gumbel((200_000,), torch.Generator().manual_seed(0))
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
    assert stats.kstest(g.double().numpy(), stats.gumbel_r.cdf).pvalue > 1e-6
    again = standard_gumbel((200_000,), torch.Generator().manual_seed(0), dtype=torch.float64)
    assert again.dtype == torch.float64 and torch.equal(again.float(), g)


def test_rows_sampled_together_equal_rows_sampled_alone():
    """The batched decoder samples many rows at once (probs_by_settings, row_uniforms, sample_rows with given
    uniforms, sample_each): every row gets, bit for bit, the probabilities and the token it gets alone with its own
    settings and generator."""
    from resispec.sampling import probs_by_settings, row_uniforms, sample_each, sample_rows

    logits = torch.randn(5, 3, 300, generator=torch.Generator().manual_seed(0)) * 3
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20, top_p=0.9),
        dict(temperature=1.0),
        dict(temperature=0.0),
        dict(temperature=1.3, top_p=0.5),
    ]
    together = probs_by_settings(logits, settings)
    for i, s in enumerate(settings):
        assert torch.equal(together[i], probs(logits[i], **s))
    flat = together[:, 0]
    gens = [torch.Generator().manual_seed(10 + i) for i in range(5)]
    u = row_uniforms(gens, (1, 1), flat)
    assert u.shape == (5, 1) and u.dtype == flat.dtype
    drawn = sample_rows(flat, 1, None, u)[:, 0]
    each = sample_each(flat, [torch.Generator().manual_seed(10 + i) for i in range(5)])
    for i in range(5):
        alone = sample_rows(flat[i : i + 1], 1, torch.Generator().manual_seed(10 + i))[0, 0]
        assert drawn[i] == alone == each[i]
