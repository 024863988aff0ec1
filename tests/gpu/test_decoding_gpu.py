"""CUDA parity of the decoder: tree-masked logits and greedy outputs match the CPU reference (skipped without CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch

from resispec.decoding import SpeculativeDecoder
from resispec.decoding.kv_cache import forward_logits, new_cache, tree_attention_mask
from resispec.decoding.tree import DraftTree
from tests.unit.test_decoding_helpers import micro_llama, noisy_copy

pytestmark = pytest.mark.gpu
VOCAB = 96


@pytest.fixture(scope="module")
def pairs():
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity, not TF32
    target = micro_llama(64, 2, VOCAB, seed=0, attention_gain=(8.0, 4.0))  # positions and masks count
    draft = noisy_copy(target, 0.5, seed=1)
    return (target, draft), (copy.deepcopy(target).cuda(), copy.deepcopy(draft).cuda())


def test_tree_logits_cpu_cuda_parity(pairs):
    logits = []
    for target, _ in pairs:
        dev = target.device
        ids = torch.arange(10, device=dev)[None] % VOCAB
        cache = new_cache(target)
        forward_logits(target, ids[:, :8], cache)
        tree = DraftTree(root_token=8, max_nodes=4)
        tree.add_level([[9, 5]])
        tree.add_level([[10], [11]])
        nodes = range(0, tree.num_nodes)
        mask = tree_attention_mask(8, tree.mask(nodes, nodes).to(dev), torch.float32)
        pos = torch.tensor([tree.depths], device=dev) + 8
        with torch.no_grad():
            logits.append(
                forward_logits(target, torch.tensor([tree.tokens], device=dev), cache, pos, mask).cpu()
            )
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "rule,tree", [("resispec", [4, 2, 1]), ("rsd", [2, 2, 2, 2]), ("chain", [1, 1, 1, 1])]
)
def test_greedy_cpu_cuda_parity(pairs, rule, tree):
    (t_cpu, d_cpu), (t_gpu, d_gpu) = pairs
    gen = torch.Generator().manual_seed(0)
    for n in (3, 9):
        ids = torch.randint(0, VOCAB, (1, n), generator=gen)
        ref = SpeculativeDecoder(t_cpu, d_cpu, rule=rule, tree=tree).generate_autoregressive(
            ids, max_new_tokens=24, temperature=0.0
        )
        for greedy_topk in (True, False):
            dec = SpeculativeDecoder(t_gpu, d_gpu, rule=rule, tree=tree, greedy_topk=greedy_topk)
            out = dec.generate(ids.cuda(), max_new_tokens=24, temperature=0.0)
            assert torch.equal(out.sequences.cpu(), ref.sequences)
        ar = dec.generate_autoregressive(ids.cuda(), max_new_tokens=24, temperature=0.0)
        assert torch.equal(ar.sequences.cpu(), ref.sequences)


@pytest.mark.parametrize("rule", ["resispec", "rrs", "gumbel"])
def test_sampling_on_cuda_follows_the_target_law(rule):
    """The batch-1 joint-law test (tests/unit/test_decoding_exactness.py: the first 3 tokens' law, Pearson X^2 at
    a checked power) with the decoder, its models and its generator on CUDA."""
    from tests.unit import test_decoding_exactness as ex

    target = micro_llama(32, 1, ex.VOCAB, seed=0, scale=24.0, attention_gain=(8.0, 4.0))
    draft = noisy_copy(target, 0.6, seed=1)
    joint, num = ex.exact_joint(target), 300
    crit = ex.powered_critical_value(joint, ex.exact_joint(draft), num)
    dec = SpeculativeDecoder(target.cuda(), draft.cuda(), rule=rule, tree=ex.TREE)
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.zeros(ex.VOCAB**3, dtype=torch.long)
    for _ in range(num):
        out = dec.generate(ex.PROMPT.cuda(), max_new_tokens=3, eos_token_id=[], generator=gen, **ex.SETTINGS)
        assert out.sequences.device.type == "cuda"
        a, b, c = out.sequences[0, 1:].tolist()
        counts[(a * ex.VOCAB + b) * ex.VOCAB + c] += 1
    stat, df = ex.pearson(counts.reshape(ex.VOCAB, ex.VOCAB, ex.VOCAB), joint, num)
    assert stat < crit, (rule, stat, crit, df)
