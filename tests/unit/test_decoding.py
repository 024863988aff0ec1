"""SpeculativeDecoder end to end on micro Llamas: greedy identity for every rule and tree shape, stop conditions,
cache compaction after every step, API errors. (Distribution exactness: test_decoding_exactness.py.)"""

from __future__ import annotations

import pytest
import torch

from resispec.decoding import SpeculativeDecoder, TokenizerMismatchError
from resispec.decoding.kv_cache import cache_length, forward_logits, new_cache
from resispec.verify import VERIFIERS
from tests.oracle_decoder import decoder
from tests.unit.test_decoding_helpers import micro_arch, micro_llama, noisy_copy, one_thread_per_module  # noqa: F401 (autouse fixture)

VOCAB = 96
SHAPES = [[1, 1, 1, 1], [4, 2, 1], [3, 3, 3], [2, 2, 2, 2]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def pair():
    """Target, a close draft (noisy copy: long accepted runs) and a far draft (other seed and dims: rejections)."""
    target = micro_llama(64, 2, VOCAB, seed=0, attention_gain=(8.0, 4.0))
    return target, noisy_copy(target, 0.5, seed=1), micro_llama(32, 1, VOCAB, seed=2)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (1, n), generator=gen) for n in (1, 3, 6, 11)]


@pytest.fixture(scope="module")
def greedy_refs(pair, prompts):
    """Target greedy via HF generate and via our AR path; they must agree before anything else is compared."""
    target = pair[0]
    dec = SpeculativeDecoder(target, pair[1], rule="chain", tree=[1])
    refs = []
    for ids in prompts:
        hf = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
        ar = dec.generate_autoregressive(ids, max_new_tokens=NEW_TOKENS, temperature=0.0)
        assert torch.equal(hf, ar.sequences), "AR baseline differs from HF generate(do_sample=False)"
        refs.append(ar.sequences)
    assert len({tuple(r[0, -NEW_TOKENS:].tolist()) for r in refs}) == len(refs)  # varied outputs
    return refs


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "reference"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rule", [*sorted(VERIFIERS), "greedy_topk"])
def test_greedy_identity(rule, shape, lean, pair, prompts, greedy_refs):
    """Each rule run on one-hot p and q (greedy_topk=False), and the default temperature-0 path (top-b drafting,
    argmax matching), must reproduce target greedy decoding token for token, on the lean and the reference step."""
    target, close, far = pair
    accepted = 0
    for i, (ids, ref) in enumerate(zip(prompts, greedy_refs, strict=True)):
        draft = close if i % 2 == 0 else far
        if rule == "greedy_topk":
            dec = decoder(target, draft, not lean, rule="resispec", tree=shape)
        else:
            dec = decoder(target, draft, not lean, rule=rule, tree=shape, greedy_topk=False)
        out = dec.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0)
        assert torch.equal(out.sequences, ref), f"prompt {i}: speculative greedy differs from target greedy"
        accepted += out.stats.num_accepted_tokens
    assert accepted > 0  # the close draft exercised accepted runs


def test_temperature_zero_ignores_the_rule(pair, prompts):
    """At temperature 0 (greedy_topk, the default) every rule's decode is rule "greedy"'s, step for step: the same
    steps, the same accepted tokens at each depth. The bench times one row a tree there (speed.rules_at)."""
    from resispec.benchmark.speed import rules_at

    target, close, _ = pair

    def counts(rule: str, ids: torch.Tensor) -> tuple:
        dec = SpeculativeDecoder(target, close, rule=rule, tree=[3, 2, 1])
        stats = dec.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0).stats
        return stats.num_drafts, stats.num_accepted_tokens, tuple(stats.accepted_per_position)

    greedy = [counts("greedy", ids) for ids in prompts]
    assert sum(c[1] for c in greedy) > 0
    for rule in sorted(VERIFIERS):
        assert [counts(rule, ids) for ids in prompts] == greedy, rule
    assert rules_at(0.0, ["chain", "resispec"]) == ["greedy"] and rules_at(0.0, []) == []
    assert rules_at(1.0, ["chain", "resispec"]) == ["chain", "resispec"]


def test_identical_draft_accepts_everything(pair, prompts, greedy_refs):
    """draft = target: every step accepts the whole path, so the draft must catch up on the deepest token."""
    target = pair[0]
    dec = SpeculativeDecoder(target, target, rule="resispec", tree=[2, 1, 1])
    out = dec.generate(prompts[2], max_new_tokens=NEW_TOKENS, temperature=0.0)
    assert torch.equal(out.sequences, greedy_refs[2])
    assert out.stats.tau == 4.0 and out.stats.per_depth_acceptance == [1.0, 1.0, 1.0]
    assert out.stats.num_drafts == NEW_TOKENS // 4 and out.stats.target_forwards == NEW_TOKENS // 4 + 1


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "reference"])
@pytest.mark.parametrize("rule", ["resispec", "rsd", "hub", "resispec_auto"])
def test_cache_after_every_step_equals_reencoding(rule, lean, pair, prompts):
    """At temperature 1 with a branching tree, accepted paths are often not the first children, so compaction
    really gathers. After each step the caches must equal encoding the committed text from scratch."""
    target, close, _ = pair
    dec = decoder(target, close, not lean, rule=rule, tree=[3, 2, 1])
    checked = []

    def check(tcache, dcache, committed):
        ids = torch.tensor([committed])
        assert cache_length(tcache) == len(committed) - 1  # everything but the new root
        for model, cache in ((target, tcache), (close, dcache)):
            ref = new_cache(model)
            forward_logits(model, ids[:, : cache_length(cache)], ref)
            for got, want in zip(cache.layers, ref.layers, strict=True):
                torch.testing.assert_close(got.keys, want.keys, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(got.values, want.values, atol=1e-4, rtol=1e-4)
        # the draft lags by the new root, plus the deepest accepted token when the whole path was accepted
        assert len(committed) - cache_length(dcache) in (1, 2)
        checked.append(len(committed))

    dec.after_step = check
    out = dec.generate(
        prompts[1], max_new_tokens=20, temperature=1.0, generator=torch.Generator().manual_seed(3)
    )
    assert checked and out.stats.num_accepted_tokens > 0


def test_stop_conditions(pair, prompts, greedy_refs):
    target, close, _ = pair
    dec = SpeculativeDecoder(target, close, rule="resispec", tree=[2, 2, 1], tokenizer=AngleTokenizer())
    ids, ref = prompts[2], greedy_refs[2]
    gen = ref[0, ids.shape[1] :].tolist()
    # max_new_tokens: exact length, whatever the step boundaries
    for n in (1, 2, 5, 7):
        out = dec.generate(ids, max_new_tokens=n, temperature=0.0)
        assert torch.equal(out.sequences, ref[:, : ids.shape[1] + n])
    # EOS: cut right after the first occurrence of the EOS token (a token from the middle of the greedy output)
    eos = gen[9]
    cut = gen.index(eos) + 1
    out = dec.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0, eos_token_id=eos)
    assert out.sequences[0, ids.shape[1] :].tolist() == gen[:cut]
    # stop strings: the token completing the stop string is the last one emitted
    stop = f"<{gen[6]}><{gen[7]}>"
    out = dec.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0, stop=["never", stop])
    emitted = out.sequences[0, ids.shape[1] :].tolist()
    assert stop in AngleTokenizer().decode(emitted) and stop not in AngleTokenizer().decode(emitted[:-1])
    # a stop_checker callable; the stream yields the same tokens in step chunks
    chunks = list(
        dec.generate_stream(
            ids, max_new_tokens=NEW_TOKENS, temperature=0.0, stop_checker=lambda g: len(g) >= 10
        )
    )
    assert [t for c in chunks for t in c] == gen[:10] and len(chunks) == dec.last_stats.num_drafts
    assert dec.last_stats.num_new_tokens == 10


def test_errors(pair, prompts):
    target, close, _ = pair
    with pytest.raises(NotImplementedError, match="batch size 1"):
        SpeculativeDecoder(target, close, rule="rrs", tree=[2]).generate(prompts[1].repeat(2, 1))
    with pytest.raises(TokenizerMismatchError):
        SpeculativeDecoder(
            target, close, tokenizer_target=AngleTokenizer(), tokenizer_draft=AngleTokenizer(VOCAB + 1)
        )
    with pytest.raises(TokenizerMismatchError, match="vocab sizes differ"):
        SpeculativeDecoder(target, micro_llama(32, 1, VOCAB + 8, seed=4))
    with pytest.raises(ValueError, match="stop strings need"):
        SpeculativeDecoder(target, close).generate(prompts[1], stop=["x"])
    with pytest.raises(KeyError, match="unknown verification rule"):
        SpeculativeDecoder(target, close, rule="nope")


class AngleTokenizer:
    """A stand-in tokenizer: token i decodes to "<i>"."""

    def __init__(self, vocab: int = VOCAB) -> None:
        self.vocab = vocab
        self.eos_token_id = None
        self.eos_token = None

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(self.vocab)}

    def __len__(self) -> int:
        return self.vocab

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


@pytest.mark.parametrize("arch", ["Qwen2", "Qwen3", "Mistral"])
def test_other_architectures_greedy_identity(arch):
    """The same cache/mask path serves Qwen2/3 and Mistral (sliding window off: the tree cache is full-attention)."""
    target, draft = (micro_arch(arch, hidden, VOCAB, seed) for seed, hidden in ((0, 64), (1, 32)))
    ids = torch.tensor([[5, 17, 33, 2]])
    hf = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    for greedy_topk in (True, False):
        dec = SpeculativeDecoder(target, draft, rule="rrs", tree=[3, 2], greedy_topk=greedy_topk)
        assert torch.equal(dec.generate(ids, max_new_tokens=12, temperature=0.0).sequences, hf)
    out = dec.generate(ids, max_new_tokens=12, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out.sequences.shape == (1, 16)


def test_sampled_walk_verifies_a_chain_in_one_rule_call(pair, prompts):
    """At temperature > 0 the lean walk verifies a chain's nodes in one batched rule call per step (walk.chain_from),
    and a [3, 1, 1] tree's depths 2-3 in one call after the root's: with the target as its own draft every draft is
    accepted, so the calls per step are exactly that."""
    target = pair[0]

    class Counting:
        def __init__(self, rule):
            self.rule, self.rows = rule, []
            self.name, self.scheme, self.greedy_only = rule.name, rule.scheme, rule.greedy_only

        def propose(self, q, n, generator=None):
            return self.rule.propose(q, n, generator)

        def verify(self, p, proposal, generator=None):
            self.rows.append(p.shape[0])
            return self.rule.verify(p, proposal, generator)

    for tree, rows in (([1, 1, 1, 1], [4]), ([3, 1, 1], [1, 2])):
        rule = Counting(VERIFIERS["resispec"])
        dec = SpeculativeDecoder(target, target, rule=rule, tree=tree)
        gen = torch.Generator().manual_seed(0)
        out = dec.generate(
            prompts[2], max_new_tokens=len(tree) + 1, temperature=1.0, generator=gen, eos_token_id=[]
        )
        assert out.sequences.shape[1] == prompts[2].shape[1] + len(tree) + 1  # one step, all accepted
        assert rule.rows == rows, tree


def test_resispec_auto_chain_whose_depths_draft_by_different_schemes(pair, prompts):
    """A chain run verified in one call can join resispec_auto rows of both branches (one depth drafted distinct, the
    next i.i.d.: their proposals carry different fields); the policy here alternates the branch at every depth."""
    from resispec.verify.registry import build_rule

    target, close, _ = pair
    rule = build_rule("resispec_auto", {"threshold": 0.5})  # a rule and policy of its own
    calls = iter(range(10**6))
    rule.policy.distinct_rows = lambda q, n: torch.full((q.shape[0],), next(calls) % 2 == 0)
    dec = SpeculativeDecoder(target, close, rule=rule, tree=[1, 1, 1, 1])
    for seed, ids in enumerate(prompts):
        gen = torch.Generator().manual_seed(seed)
        out = dec.generate(ids, max_new_tokens=NEW_TOKENS, temperature=1.0, generator=gen, eos_token_id=[])
        assert out.sequences.shape[1] == ids.shape[1] + NEW_TOKENS
