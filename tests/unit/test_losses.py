"""Distillation losses: the divergences against their formulas, the residual loss against resispec.verify,
the top-K + tail representation, masking, weights and the decode processing."""

from __future__ import annotations

import pytest
import torch

from resispec.decoding.config import DecodeConfig
from resispec.losses import (
    TargetSignal,
    bucket_draft,
    check_loss_config,
    distill_loss,
    fkl,
    jsd,
    lk,
    paired_logprobs,
    position_weights,
    reach_weights,
    residual,
    residual_draws,
    residual_num_draws,
    residual_rule,
    residual_weighted_fkl,
    rkl,
    run_positions,
    sparse_with_tail,
    tvd,
)
from resispec.sampling import log_probs
from resispec.training.config import LossConfig


def _logits(n=6, v=11, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


def _logp(n=6, v=11, seed=0):
    return _logits(n, v, seed).log_softmax(-1)


def test_divergences_match_their_formulas():
    lp, lq = _logp(seed=0), _logp(seed=1)
    p, q = lp.exp(), lq.exp()
    torch.testing.assert_close(fkl(lp, lq), (p * (p / q).log()).sum(-1))
    torch.testing.assert_close(rkl(lp, lq), (q * (q / p).log()).sum(-1))
    torch.testing.assert_close(tvd(lp, lq), 1 - torch.minimum(p, q).sum(-1))
    m = 0.3 * p + 0.7 * q
    want = 0.3 * (p * (p / m).log()).sum(-1) + 0.7 * (q * (q / m).log()).sum(-1)
    torch.testing.assert_close(jsd(lp, lq, 0.3), want)
    for f in (fkl, rkl, tvd, jsd):
        assert (f(lp, lq) > 0).all()
        torch.testing.assert_close(f(lp, lp), torch.zeros(lp.shape[0]), atol=1e-6, rtol=0)


def test_jsd_beta_out_of_range_fails():
    with pytest.raises(ValueError, match="jsd_beta"):
        jsd(_logp(), _logp(seed=1), 1.0)


def test_residual_calls_verify_acceptance():
    """1 - alpha is exactly one minus resispec.verify's acceptance for every closed-form rule and n."""
    from resispec.verify import VERIFIERS

    lp, lq = _logp(seed=2), _logp(seed=3)
    for rule in ("chain", "rrs", "kseq", "resispec"):
        if rule not in VERIFIERS:
            continue
        for n in (1, 2, 4):
            want = 1 - VERIFIERS[rule].acceptance(lp.exp(), lq.exp(), n)
            got = residual(lp, lq, rule=rule, n=n, form="plain", fkl_weight=0.0)
            torch.testing.assert_close(got, want)
    # the one-draft chain rule accepts sum min(p, q): its residual loss is the total variation
    torch.testing.assert_close(residual(lp, lq, rule="chain", n=1, form="plain", fkl_weight=0), tvd(lp, lq))


def test_residual_forms():
    lp, lq = _logp(seed=4), _logp(seed=5)
    plain = residual(lp, lq, rule="resispec", n=4, form="plain", fkl_weight=0)
    alpha = 1 - plain
    torch.testing.assert_close(residual(lp, lq, rule="resispec", n=4, form="log", fkl_weight=0), -alpha.log())
    torch.testing.assert_close(
        residual(lp, lq, rule="resispec", n=4, form="hybrid", fkl_weight=0.3), plain + 0.3 * fkl(lp, lq)
    )
    with pytest.raises(ValueError, match="form"):
        residual(lp, lq, rule="resispec", n=4, form="bogus", fkl_weight=0)


def test_residual_gradient_reaches_the_draft_and_helps():
    """The gradient flows through q only; a small step on the draft logits raises alpha."""
    lp = _logp(seed=6)
    q_logits = _logits(seed=7).requires_grad_(True)
    loss = residual(lp, q_logits.log_softmax(-1), rule="resispec", n=4, form="plain", fkl_weight=0).mean()
    loss.backward()
    assert q_logits.grad is not None and q_logits.grad.abs().sum() > 0
    with torch.no_grad():
        stepped = q_logits - 0.5 * q_logits.grad / q_logits.grad.norm()
        after = residual(lp, stepped.log_softmax(-1), rule="resispec", n=4, form="plain", fkl_weight=0).mean()
    assert after < loss


def test_residual_rule_and_draws_come_from_decode():
    decode = DecodeConfig(rule="rrs", tree=[3, 2, 1])
    assert residual_rule(LossConfig(), decode) == "rrs" and residual_num_draws(LossConfig(), decode) == 3
    assert residual_rule(LossConfig(rule="kseq", num_draws=2), decode) == "kseq"
    assert residual_num_draws(LossConfig(num_draws=2), decode) == 2
    assert residual_rule(LossConfig(), DecodeConfig(rule="resispec_auto")) == "resispec_auto"


def test_tree_draws_average_alpha_over_the_depths():
    decode = DecodeConfig(tree=[4, 2, 1, 1])
    assert residual_draws(LossConfig(draws="tree"), decode) == [(1, 0.5), (2, 0.25), (4, 0.25)]
    w = residual_draws(LossConfig(draws="tree", depth_decay=0.5), decode)  # depth weights 1, .5, .25, .125
    assert [n for n, _ in w] == [1, 2, 4]
    assert [x for _, x in w] == pytest.approx([0.375 / 1.875, 0.5 / 1.875, 1 / 1.875])
    assert residual_draws(LossConfig(), decode) == [(4, 1.0)]
    lp, lq = _logp(seed=20), _logp(seed=21)
    from resispec.verify import VERIFIERS

    rule = VERIFIERS["resispec"]
    want = 1 - (
        0.5 * rule.acceptance(lp.exp(), lq.exp(), 1)
        + 0.25 * rule.acceptance(lp.exp(), lq.exp(), 2)
        + 0.25 * rule.acceptance(lp.exp(), lq.exp(), 4)
    )
    got = residual(lp, lq, rule="resispec", n=[(1, 0.5), (2, 0.25), (4, 0.25)], form="plain", fkl_weight=0)
    torch.testing.assert_close(got, want)


def test_rule_without_closed_form_fails_early():
    with pytest.raises(ValueError, match="closed-form"):
        check_loss_config(LossConfig(name="residual", rule="rsd"), DecodeConfig())
    with pytest.raises(ValueError, match="unknown loss"):
        check_loss_config(LossConfig(name="kl"), DecodeConfig())


def test_sparse_with_all_tokens_equals_dense():
    """Top-K with K = V: the tail is empty and every loss equals the dense one."""
    t_logits, q_logits = _logits(seed=8), _logits(seed=9)
    decode = DecodeConfig(temperature=0.7, tree=[4])
    top = torch.topk(log_probs(t_logits, 0.7), 11, dim=-1)
    sparse = TargetSignal(top.values, top.indices)
    lp_d, lq_d = paired_logprobs(TargetSignal(t_logits), q_logits, decode, truncate=False)
    lp_s, lq_s = paired_logprobs(sparse, q_logits, decode, truncate=False)
    for f in (fkl, tvd):
        torch.testing.assert_close(f(lp_s, lq_s), f(lp_d, lq_d), atol=1e-5, rtol=1e-5)
    a_d = residual(lp_d, lq_d, rule="resispec", n=4, form="plain", fkl_weight=0)
    a_s = residual(lp_s, lq_s, rule="resispec", n=4, form="plain", fkl_weight=0)
    torch.testing.assert_close(a_s, a_d, atol=1e-5, rtol=1e-5)


def test_sparse_buckets_are_distributions_on_one_support():
    t_logp, q_logp = _logp(seed=10, v=50), _logp(seed=11, v=50)
    top = torch.topk(t_logp, 5, dim=-1)
    lp = sparse_with_tail(top.values)  # [N, 6]
    lq = bucket_draft(q_logp, top.indices)  # [N, 6]
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(6))
    torch.testing.assert_close(lq.exp().sum(-1), torch.ones(6))
    torch.testing.assert_close(lq[:, :5], q_logp.gather(-1, top.indices))
    # merging tokens can only increase the overlap: the bucketed tvd is a lower bound of the dense one
    assert (tvd(lp, lq) <= tvd(t_logp, q_logp) + 1e-6).all()


def test_residual_sees_top_p_and_divergences_do_not():
    t_logits, q_logits = _logits(seed=12), _logits(seed=13)
    decode = DecodeConfig(top_p=0.5)
    lp, _ = paired_logprobs(TargetSignal(t_logits), q_logits, decode, truncate=True)
    assert torch.isinf(lp).any()
    lp, _ = paired_logprobs(TargetSignal(t_logits), q_logits, decode, truncate=False)
    assert torch.isfinite(lp).all()
    loss, _ = distill_loss(
        q_logits[None], TargetSignal(t_logits[None]), torch.ones(1, 6), LossConfig(), decode
    )
    assert torch.isfinite(loss)


def test_masked_positions_do_not_count():
    t, q = _logits(n=8, seed=14)[None], _logits(n=8, seed=15)[None]  # [1, 8, V]
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 0]])
    q2 = q.clone()
    q2[0, mask[0] == 0] += 5 * torch.randn_like(q2[0, mask[0] == 0])
    for name in ("fkl", "tvd", "residual"):
        a, _ = distill_loss(q, TargetSignal(t), mask, LossConfig(name=name), DecodeConfig())
        b, _ = distill_loss(q2, TargetSignal(t), mask, LossConfig(name=name), DecodeConfig())
        torch.testing.assert_close(a, b)
    # and the value is the plain mean of the per-position losses over the 4 masked positions
    loss, stats = distill_loss(q, TargetSignal(t), mask, LossConfig(name="fkl"), DecodeConfig())
    sel = mask[0].bool()
    torch.testing.assert_close(loss, fkl(t[0, sel].log_softmax(-1), q[0, sel].log_softmax(-1)).mean())
    assert stats["num_positions"] == 4


def test_position_weights_decay_with_depth():
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1, 1]])
    assert run_positions(mask).tolist() == [[0, 0, 1, 2, 3, 4, 0, 0, 1]]
    w = position_weights(mask, depth_decay=0.5, depth=3)
    assert w.tolist() == [[0, 1, 0.5, 0.25, 1, 0.5, 0, 1, 0.5]]
    assert position_weights(mask, 1.0, 3).tolist() == mask.float().tolist()


def test_empty_mask_gives_zero_with_a_graph():
    q = _logits(n=4, seed=16)[None].requires_grad_(True)
    loss, stats = distill_loss(
        q, TargetSignal(_logits(n=4)[None]), torch.zeros(1, 4), LossConfig(), DecodeConfig()
    )
    loss.backward()
    assert loss.item() == 0 and stats["num_positions"] == 0


# ----------------------------------------------------------------------------- LK and the residual-focused losses
def test_lk_reduces_to_its_known_cases():
    """eta = 0 is pure fkl, a large eta is 1 - alpha_chain = tvd, `log` is -log sum min(p, q)."""
    lp, lq = _logp(seed=30), _logp(seed=31)
    pair = (lp, lq)
    torch.testing.assert_close(lk(lp, lq, pair, form="lambda", eta=0.0), fkl(lp, lq))
    torch.testing.assert_close(lk(lp, lq, pair, form="log_lambda", eta=0.0), fkl(lp, lq))
    torch.testing.assert_close(lk(lp, lq, pair, form="lambda", eta=200.0), tvd(lp, lq), atol=1e-6, rtol=1e-5)
    overlap = torch.minimum(lp.exp(), lq.exp()).sum(-1)
    torch.testing.assert_close(lk(lp, lq, pair, form="log", eta=3.0), -overlap.log())
    lam = torch.exp(-3.0 * overlap)
    want = lam * fkl(lp, lq) + (1 - lam) * (1 - overlap)
    torch.testing.assert_close(lk(lp, lq, pair, form="lambda", eta=3.0), want)
    with pytest.raises(ValueError, match="lk loss form"):
        lk(lp, lq, pair, form="hybrid", eta=3.0)


def test_residual_weighted_fkl_is_fkl_reweighted_by_the_residual():
    lp, lq = _logp(seed=32), _logp(seed=33)
    alpha = torch.full((6,), 0.7)
    torch.testing.assert_close(
        residual_weighted_fkl(lp, lq, alpha), fkl(lp, lq)
    )  # equal residuals: plain fkl
    alpha = torch.tensor([0.2, 0.4, 0.6, 0.8, 1.0, 0.5])
    w = (1 - alpha) / (1 - alpha).mean()
    torch.testing.assert_close(residual_weighted_fkl(lp, lq, alpha), w * fkl(lp, lq))
    assert residual_weighted_fkl(lp, lq, alpha)[4] == 0  # a fully accepted position does not train


def test_reach_weights_are_the_derivatives_of_tau():
    a = [0.9, 0.7, 0.5, 0.3]

    def tau(x):
        return 1 + sum(torch.stack(x[:k]).prod() for k in range(1, len(x) + 1))

    x = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in a]
    tau(x).backward()
    assert reach_weights(a) == pytest.approx([v.grad.item() for v in x])
    assert reach_weights([1.0, 1.0, 1.0]) == pytest.approx([3, 2, 1])  # depth d unlocks D - d tokens


def test_reach_draws_group_the_tree_by_n():
    decode = DecodeConfig(tree=[4, 2, 1, 1])
    lp, lq = _logp(seed=34), _logp(seed=35)
    draws = residual_draws(LossConfig(draws="reach"), decode, (lp, lq))
    assert [n for n, _ in draws] == [1, 2, 4] and sum(w for _, w in draws) == pytest.approx(1.0)
    from resispec.verify import VERIFIERS

    a = {n: VERIFIERS["resispec"].acceptance(lp.exp(), lq.exp(), n).mean().item() for n in (1, 2, 4)}
    g = reach_weights([a[4], a[2], a[1], a[1]])
    assert [w for _, w in draws] == pytest.approx([(g[2] + g[3]) / sum(g), g[1] / sum(g), g[0] / sum(g)])
    # without the pair (config checks) the depths weigh the same
    assert residual_draws(LossConfig(draws="reach"), decode) == [(1, 0.5), (2, 0.25), (4, 0.25)]


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(name="lk", form="lambda"),
        LossConfig(name="lk", form="log"),
        LossConfig(name="lk", form="log_lambda"),
        LossConfig(name="fkl_residual", draws="tree"),
        LossConfig(name="fkl_residual", draws="reach"),
        LossConfig(name="residual", draws="reach"),
    ],
    ids=lambda c: f"{c.name}-{c.form}-{c.draws}",
)
@pytest.mark.parametrize("sparse", [False, True])
def test_new_losses_train_with_finite_gradients(cfg, sparse):
    """Every new loss runs through distill_loss (dense and top-K targets, top-p served), gives finite gradients,
    and a small step along them lowers it."""
    decode = DecodeConfig(tree=[4, 2, 1, 1], top_p=0.95)
    check_loss_config(cfg, decode)
    t = _logits(n=8, seed=36)[None]
    if sparse:
        top = torch.topk(log_probs(t[0], decode.temperature), 6, dim=-1)
        target = TargetSignal(top.values[None], top.indices[None])
    else:
        target = TargetSignal(t)
    q = _logits(n=8, seed=37)[None].requires_grad_(True)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0]])
    loss, _ = distill_loss(q, target, mask, cfg, decode)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    with torch.no_grad():
        after, _ = distill_loss(q - 0.3 * q.grad / q.grad.norm(), target, mask, cfg, decode)
    assert after < loss
