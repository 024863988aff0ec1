"""The draft head (resispec/models/head.py) on micro Llamas: the training-time-test unroll computes what decoding
computes (every tree node's logits equal the unroll's along its path), save/load, reduced vocabulary, and the head
as a drafter of the one speculative step: greedy identity for every rule and tree, and the joint law of the first
tokens for every sampling rule (the chi-square helpers of test_decoding_exactness.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from resispec.decoding import SpeculativeDecoder
from resispec.decoding.head_draft import HeadLevels, prefill_pending, target_forward
from resispec.decoding.kv_cache import new_cache
from resispec.decoding.tree import DraftTree, max_tree_nodes
from resispec.models.head import DraftHead, HeadConfigError, default_layers, is_head_dir
from resispec.verify import VERIFIERS
from tests.unit import test_decoding_exactness as exactness
from tests.unit.test_decoding_helpers import (  # noqa: F401 (one_thread_per_module: autouse fixture)
    micro_llama,
    mixed_batch_joint_counts,
    one_thread_per_module,
)

VOCAB = 16
SHAPES = [[1, 1, 1, 1], [4, 2, 1], [3, 3, 3], [2, 2, 2, 2]]


def fit_head(target, steps: int = 120, ttt_steps: int = 3, seed: int = 0, **head_kwargs) -> DraftHead:
    """A head trained briefly (forward KL over the unroll) on the target's own samples: it accepts often."""
    torch.manual_seed(seed)
    head = DraftHead.from_target(target, seed=seed, **head_kwargs)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (32, 2), generator=gen)
    with torch.no_grad():
        for _ in range(14):
            probs = target(input_ids=ids).logits[:, -1].softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
        out = target(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in head.layers], dim=-1)
        log_p = out.logits.log_softmax(-1)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    head.train()
    for _ in range(steps):
        loss = 0.0
        for j, h in enumerate(head.ttt(feats, ids, ttt_steps)):
            log_q = head.target_logits(h[:, : ids.shape[1] - 1 - j]).log_softmax(-1)  # index i predicts i+2+j
            p = log_p[:, 1 + j :]
            loss = loss + 0.8**j * F.kl_div(log_q, p, log_target=True, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def target():
    return micro_llama(32, 4, VOCAB, seed=0, scale=24.0, attention_gain=(8.0, 4.0))


@pytest.fixture(scope="module")
def head(target):
    return fit_head(target)


def test_default_layers_follow_eagle3():
    assert default_layers(32) == [2, 16, 29] and default_layers(12) == [2, 6, 9]
    assert default_layers(2) == [0, 1] and default_layers(4) == [1, 2]


def test_bad_layer_ids_and_vocab_are_user_errors(target):
    with pytest.raises(HeadConfigError, match="0..3"):
        DraftHead.from_target(target, layers=[0, 4])
    with pytest.raises(HeadConfigError, match="draft_vocab_size"):
        DraftHead.from_target(target, draft_vocab_size=VOCAB + 1)


def test_unroll_matches_decoding_on_every_tree_node(target):
    """Each node's draft logits in decoding (depth 0 over the prompt's target features, deeper levels over the
    parent's state under the tree mask) equal the training-time-test unroll's at the root index along its path."""
    head = DraftHead.from_target(target, seed=3)
    with torch.no_grad():  # make the layer's attention count, so that masks and positions matter
        for proj in (head.midlayer.self_attn.q_proj, head.midlayer.self_attn.k_proj):
            proj.weight.mul_(20.0)
    prompt = [3, 7, 1, 12, 5, 9]
    num = len(prompt)
    tcache = new_cache(target)
    with torch.no_grad():
        _, feats = target_forward(target, head.layers, torch.tensor([prompt[:-1]]), tcache)
        levels = HeadLevels(
            head, prefill_pending(prompt, feats, "cpu"), new_cache(head), num, VOCAB, lambda f: f()
        )
        shape = [2, 2, 1]
        tree = DraftTree(prompt[-1], max_tree_nodes(shape))
        logits = levels.first()
        node_logits = {0: logits[0]}
        for depth, width in enumerate(shape, 1):
            level = tree.add_level(torch.topk(logits, width, dim=-1).indices.tolist())
            if depth == len(shape):
                break
            logits = levels.deeper(tree, level, depth)
            node_logits.update({n: logits[n - level.start] for n in level})
        for node, got in node_logits.items():
            path = [tree.tokens[n] for n in tree.path_to(node)]
            ids = torch.tensor([prompt + path])
            out = target(input_ids=ids, output_hidden_states=True)
            all_feats = torch.cat([out.hidden_states[i] for i in head.layers], dim=-1)
            unroll = head.ttt(all_feats, ids, len(path) + 1)[len(path)]
            want = head.target_logits(unroll[0, num - 2])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_save_load_round_trip(target, head, tmp_path):
    head.save_pretrained(tmp_path / "h")
    assert is_head_dir(tmp_path / "h") and not is_head_dir(tmp_path)
    again = DraftHead.from_pretrained(tmp_path / "h", target)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    torch.testing.assert_close(again(ids).logits, head(ids).logits)


def test_reduced_vocabulary_maps_ids(target):
    counts = torch.arange(VOCAB, dtype=torch.float64)  # the most frequent: the highest ids
    head = DraftHead.from_target(target, draft_vocab_size=6, token_counts=counts)
    assert head.draft_to_target.tolist() == list(range(10, 16)) and int(head.t2d.sum()) == 6
    logits = head.target_logits(torch.randn(2, 32))
    assert logits.shape == (2, VOCAB) and bool((logits[:, :10] == torch.finfo(logits.dtype).min).all())


def test_reduced_vocabulary_loss_mask_drops_out_of_vocabulary_targets(target):
    """EAGLE-3's loss mask: a position counts only where the target's argmax is in the draft vocabulary."""
    from resispec.losses import Rows
    from resispec.training.head_step import in_draft_vocab

    head = DraftHead.from_target(
        target, draft_vocab_size=6, token_counts=torch.arange(VOCAB, dtype=torch.float64)
    )
    lm_head = target.get_output_embeddings()
    rows = torch.randn(40, 32)
    top = (rows @ lm_head.weight.T).argmax(-1)
    got = in_draft_vocab(head, Rows(rows, lm_head.weight, lm_head.bias), chunk=7)
    assert got.tolist() == (top >= 10).tolist() and 0 < int(got.sum()) < 40


def test_heldout_depth0_is_the_causal_view(target, head):
    """The held-out evaluation's depth 0 (the unroll's step 0 at index t-1) is the head's causal view at row t;
    depth d reads step d at index t-1-d (the unroll equals decoding on every node: test above)."""
    from resispec.decoding.config import DecodeConfig
    from resispec.training.head_step import head_heldout_logprobs

    ids = torch.tensor([3, 5, 1, 7, 2, 9, 4, 4, 11])
    dec = DecodeConfig()
    with torch.no_grad():
        log_p, log_q = head_heldout_logprobs(head, target, ids, 4, 3, dec)
        view = head(ids[None]).logits[0, 3:-1].log_softmax(-1)
        ttt = head.ttt(
            torch.cat(
                [target(ids[None], output_hidden_states=True).hidden_states[i] for i in head.layers], -1
            ),
            ids[None],
            3,
        )
    assert len(log_q) == 3 and log_p.shape == log_q[0].shape == (5, VOCAB)
    torch.testing.assert_close(log_q[0], view, atol=1e-5, rtol=0)
    rows = torch.arange(3, 8)  # target rows of the 5 response tokens
    torch.testing.assert_close(
        log_q[2], head.target_logits(ttt[2][0, rows - 3]).log_softmax(-1), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rule", [*sorted(VERIFIERS), "greedy_topk"])
def test_greedy_identity_with_a_head(rule, shape, target, head):
    """As test_decoding.py's greedy identity, the head as the drafter: token-identical to target greedy."""
    check_greedy_identity(rule, shape, target, head)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES[2:], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rule", [*sorted(VERIFIERS), "greedy_topk"])
def test_greedy_identity_with_a_head_more_trees(rule, shape, target, head):
    check_greedy_identity(rule, shape, target, head)


def check_greedy_identity(rule, shape, target, head) -> None:
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    for n in (1, 3, 7):
        ids = torch.randint(0, VOCAB, (1, n), generator=gen)
        if rule == "greedy_topk":
            dec = SpeculativeDecoder(target, head, rule="resispec", tree=shape)
        else:
            dec = SpeculativeDecoder(target, head, rule=rule, tree=shape, greedy_topk=False)
        ref = dec.generate_autoregressive(ids, max_new_tokens=16, temperature=0.0, eos_token_id=[]).sequences
        out = dec.generate(ids, max_new_tokens=16, temperature=0.0, eos_token_id=[])
        assert torch.equal(out.sequences, ref), f"prompt {n}: speculative greedy differs from target greedy"
        accepted += out.stats.num_accepted_tokens
    assert accepted > 0


def test_trained_head_accepts_more_than_a_fresh_one(target, head):
    prompt = torch.tensor([[3, 5]])
    taus = []
    for h in (DraftHead.from_target(target, seed=1), head):
        dec = SpeculativeDecoder(target, h, rule="resispec", tree=[1, 1, 1])
        taus.append(dec.generate(prompt, max_new_tokens=40, temperature=0.0, eos_token_id=[]).stats.tau)
    assert taus[1] > taus[0] + 0.5, taus


HEAD_PROMPT = torch.tensor([[3, 5]])  # two tokens: the head drafts from the first step (a feature exists)


def joint_after(model, prompt: torch.Tensor) -> torch.Tensor:
    """[V, V, V] law of the 3 tokens after `prompt` under exactness.SETTINGS (exactness.exact_joint for a prompt of
    any length), by enumeration."""
    from resispec import sampling

    tails = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [V^2, 2]
    ids = torch.cat([prompt.expand(VOCAB * VOCAB, -1), tails], dim=1)
    with torch.no_grad():
        logits = model(ids).logits[:, -3:]  # [V^2, 3, V]
    probs = sampling.probs(logits.reshape(-1, VOCAB), **exactness.SETTINGS).reshape(VOCAB * VOCAB, 3, VOCAB)
    probs = probs.double()
    p1, p2, p3 = probs[0, 0], probs[::VOCAB, 1], probs[:, 2].reshape(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.fixture(scope="module")
def law(target):
    """(target joint law of 3 tokens after HEAD_PROMPT, a wrong law for the power check: a noisy copy's)."""
    from tests.unit.test_decoding_helpers import noisy_copy

    return joint_after(target, HEAD_PROMPT), joint_after(noisy_copy(target, 0.6, seed=1), HEAD_PROMPT)


@pytest.mark.parametrize("rule", ["resispec", "rrs", "gumbel"])
def test_joint_law_with_a_head(rule, target, head, law):
    check_head_law(rule, [2, 2, 1], target, head, law)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [[2, 2, 1], [1, 1, 1]], ids=["2x2x1", "chain"])
@pytest.mark.parametrize("rule", exactness.SAMPLING_RULES)
def test_joint_law_with_a_head_every_rule(rule, tree, target, head, law):
    check_head_law(rule, tree, target, head, law)


def check_head_law(rule, tree, target, head, law, num: int = 300) -> None:
    """exactness.check_rule with the head as the drafter, after HEAD_PROMPT."""
    joint, wrong = law
    crit = exactness.powered_critical_value(joint, wrong, num)
    dec = SpeculativeDecoder(target, head, rule=rule, tree=tree)
    gen = torch.Generator().manual_seed(exactness.SAMPLING_RULES.index(rule))
    counts = torch.zeros(VOCAB**3, dtype=torch.long)
    for _ in range(num):
        out = dec.generate(
            HEAD_PROMPT, max_new_tokens=3, eos_token_id=[], generator=gen, **exactness.SETTINGS
        )
        a, b, c = out.sequences[0, HEAD_PROMPT.shape[1] :].tolist()
        counts[(a * VOCAB + b) * VOCAB + c] += 1
    stat, df = exactness.pearson(counts.reshape(VOCAB, VOCAB, VOCAB), joint, num)
    assert stat < crit, (
        f"{rule}: X^2 = {stat:.1f} >= {crit:.1f} (df {df}): output law differs from the target's"
    )


# ---------------------------------------------------------------------------- batched (resispec/decoding/batch_spec.py)
BATCH_PROMPTS = [[4], [3, 9, 1], [7, 2, 2, 5, 11, 0, 3], [8, 8, 1, 6]]


def _alone(dec, prompt, new=16, **settings):
    out = dec.generate(torch.tensor([prompt]), max_new_tokens=new, eos_token_id=[], **settings)
    return out.sequences[0, len(prompt) :].tolist(), out.stats


@pytest.mark.parametrize("tree", [pytest.param((1, 1, 1), marks=pytest.mark.slow), (3, 2, 1)])
def test_batched_head_greedy_rows_equal_alone(tree, target, head):
    """Greedy rows decoded with the head in a batch (rows joining a running batch, steps with and without
    speculation) give the target's greedy tokens, and accept what the batch-1 decoder accepts: the head's side of
    the batched step (pairs, parents' states, masks, positions) is the batch-1 step's."""
    from resispec.decoding.batch import BatchedSpeculativeDecoder

    dec = SpeculativeDecoder(target, head, rule="resispec", tree=list(tree))
    bs = BatchedSpeculativeDecoder.from_decoder(dec)
    rows = [bs.add(p, max_new_tokens=16, temperature=0.0, eos_token_id=[]) for p in BATCH_PROMPTS[:2]]
    bs.step()
    rows += [bs.add(p, max_new_tokens=16, temperature=0.0, eos_token_id=[]) for p in BATCH_PROMPTS[2:]]
    while bs.rows:
        bs.step()
    for p, row in zip(BATCH_PROMPTS, rows, strict=True):
        tokens, stats = _alone(dec, p, temperature=0.0)
        ar = dec.generate_autoregressive(
            torch.tensor([p]), max_new_tokens=16, temperature=0.0, eos_token_id=[]
        )
        assert row.generated == tokens == ar.sequences[0, len(p) :].tolist()
        assert row.stats.num_accepted_tokens == stats.num_accepted_tokens, p
    assert sum(r.stats.num_accepted_tokens for r in rows) > 0
    assert bs.tcache.num_cols == 0 and bs.dcache.num_cols == 0


def test_batched_head_speculation_off_and_on(target, head):
    """AR steps (no row drafts) owe the head their (feature, token) pairs: greedy tokens unchanged."""
    from resispec.decoding.batch import BatchedSpeculativeDecoder

    dec = SpeculativeDecoder(target, head, rule="resispec", tree=[2, 1])
    bs = BatchedSpeculativeDecoder.from_decoder(dec)
    rows = [bs.add(p, max_new_tokens=16, temperature=0.0, eos_token_id=[]) for p in BATCH_PROMPTS]
    step = 0
    while bs.rows:
        bs.step(step % 3 != 1)
        step += 1
    for p, row in zip(BATCH_PROMPTS, rows, strict=True):
        assert row.generated == _alone(dec, p, temperature=0.0)[0]
    assert sum(r.stats.num_accepted_tokens for r in rows) > 0


@pytest.mark.parametrize(
    "rule,tree",
    [
        pytest.param("resispec", (1, 1, 1), marks=pytest.mark.slow),
        ("resispec", (2, 2, 1)),
        pytest.param("gumbel", (2, 1), marks=pytest.mark.slow),
    ],
)
def test_batched_head_sampled_rows_equal_alone(rule, tree, target, head):
    """Sampled rows (own generator, own temperature) next to a greedy neighbour: the batch-1 decoder's tokens.
    Without top-k / top-p: the head's logits in a batch differ from its batch-1 logits by float rounding (~1e-6, the
    batch's shapes), which a nucleus cut can turn into a different token set (measured: 3 rows of 6 differ with
    top_p=0.9 at T=1.2, none without); the law is exact either way (the joint-law tests)."""
    from resispec.decoding.batch import BatchedSpeculativeDecoder

    dec = SpeculativeDecoder(target, head, rule=rule, tree=list(tree))
    bs = BatchedSpeculativeDecoder.from_decoder(dec)
    settings = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.2)]
    rows = [
        bs.add(
            BATCH_PROMPTS[i + 1],
            max_new_tokens=14,
            eos_token_id=[],
            generator=torch.Generator().manual_seed(i),
            **s,
        )
        for i, s in enumerate(settings)
    ]
    bs.add(BATCH_PROMPTS[0], max_new_tokens=16, temperature=0.0, eos_token_id=[])
    while bs.rows:
        bs.step()
    for i, (row, s) in enumerate(zip(rows, settings, strict=True)):
        gen = torch.Generator().manual_seed(i)
        assert row.generated == _alone(dec, BATCH_PROMPTS[i + 1], 14, generator=gen, **s)[0], (rule, tree, s)


def test_batched_head_joint_law_inside_a_mixed_batch(target, head, law):
    """The joint law of 3 tokens after HEAD_PROMPT for rows decoded with the head in batches of 10 observed rows plus
    a greedy and a cooler neighbour (test_batch_decoding's mixed-batch law test, the head drafting)."""
    from resispec.decoding.batch import BatchedSpeculativeDecoder

    joint, wrong = law
    num = 300
    crit = exactness.powered_critical_value(joint, wrong, num)
    bs = BatchedSpeculativeDecoder(target, head, rule="resispec", tree=[2, 2, 1])
    counts = mixed_batch_joint_counts(bs, HEAD_PROMPT[0], VOCAB, num, 5000, exactness.SETTINGS)
    stat, df = exactness.pearson(counts.reshape(VOCAB, VOCAB, VOCAB), joint, num)
    assert stat < crit, f"X^2 = {stat:.1f} >= {crit:.1f} (df {df}) inside a mixed batch with the head"
