"""Draft tree bookkeeping and the KV-cache adapter: tree-masked logits equal sequential ones, compaction equals
re-encoding the accepted text."""

from __future__ import annotations

import torch

from resispec.decoding.kv_cache import (
    cache_length,
    compact_cache,
    crop_cache,
    forward_logits,
    new_cache,
    tree_attention_mask,
)
from resispec.decoding.tree import DraftTree, max_tree_nodes, parse_tree
from tests.unit.test_decoding_helpers import micro_llama


def test_tree_merges_repeats_and_skips_empty_slots():
    tree = DraftTree(root_token=7, max_nodes=max_tree_nodes([3, 2]))
    level = tree.add_level([[4, 4, 9]])  # i.i.d. repeat of 4 -> one child
    assert list(level) == [1, 2] and tree.tokens == [7, 4, 9]
    level = tree.add_level([[5, -1], [5, 6]])  # -1 = empty slot; the same token under two parents = two nodes
    assert list(level) == [3, 4, 5] and tree.parents == [-1, 0, 0, 1, 2, 2]
    assert tree.depths == [0, 1, 1, 2, 2, 2] and tree.path_to(5) == [2, 5]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 0, 1, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.mask(range(0, 6), range(0, 6)), expected)
    assert len(tree.add_level([[-1], [-1], [-1]])) == 0 and tree.depth == 2  # an empty level is not added


def test_chain_from_runs_of_one_child_nodes():
    """The nodes the sampled walk verifies in one rule call: down through nodes with one child and as many draws,
    never a leaf, and a branching node only as the last of a run."""
    from types import SimpleNamespace

    from resispec.decoding.walk import chain_from

    def build(levels, draws):
        tree = DraftTree(root_token=0, max_nodes=32)
        for level in levels:
            tree.add_level(level)
        return tree, [SimpleNamespace(num_draws=d) for d in draws]

    chain, props = build([[[5]], [[6]], [[7]], [[8]]], [1, 1, 1, 1])  # [1, 1, 1, 1]
    assert chain_from(chain, props, 0) == [0, 1, 2, 3]  # the leaf (node 4) is not verified
    assert chain_from(chain, props, 2) == [2, 3]
    # [2, 1, 1]: the root branches (alone); below it each depth-1 node runs to depth 2
    tree, props = build([[[5, 6]], [[7], [8]], [[9], [10]]], [2, 1, 1])
    assert chain_from(tree, props, 0) == [0] and chain_from(tree, props, 1) == [1, 3]
    # two equal i.i.d. draws make one child: a run only where the next node drafts as many draws
    tree, props = build([[[5, 5]], [[6, 7]], [[8], [9]]], [2, 2, 1])
    assert chain_from(tree, props, 0) == [0, 1]
    tree, props = build([[[5, 5]], [[6]], [[7]]], [2, 1, 1])
    assert chain_from(tree, props, 0) == [0]


def test_parse_tree_rejects_bad_shapes():
    assert parse_tree([4, 2, 1]) == [4, 2, 1] and max_tree_nodes([4, 2, 1]) == 4 + 8 + 8
    for bad in ([], [2, 0]):
        try:
            parse_tree(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


def test_tree_mask_logits_equal_sequential_and_compaction_equals_reencoding():
    torch.manual_seed(0)
    model = micro_llama(64, 2, 64, seed=0, attention_gain=(8.0, 4.0))
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        full = model(ids).logits[0]  # [12, V] plain causal reference
        cache = new_cache(model)
        forward_logits(model, ids[:, :8], cache)
        # tree over the prefix: node 1 = ids[8] (true path), node 2 = a sibling, node 3 = ids[9] under node 1,
        # node 4 = a child of the sibling
        tree = DraftTree(root_token=int(ids[0, 8]), max_nodes=4)
        tree.add_level([[int(ids[0, 9]), 5]])
        tree.add_level([[int(ids[0, 10])], [11]])
        nodes = range(0, tree.num_nodes)  # root = ids[8] at position 8, then the 4 nodes
        mask = tree_attention_mask(8, tree.mask(nodes, nodes), torch.float32)
        pos = torch.tensor([tree.depths]) + 8
        logits = forward_logits(model, torch.tensor([tree.tokens]), cache, pos, mask)[0]  # [5, V]
        torch.testing.assert_close(logits[[0, 1, 3]], full[8:11], atol=1e-5, rtol=1e-5)
        # accept the true path (root, node 1, node 3): gather + truncate must equal encoding ids[:11] from scratch
        compact_cache(cache, 8, torch.tensor([0, 1, 3]))
        assert cache_length(cache) == 11
        ref = new_cache(model)
        forward_logits(model, ids[:, :11], ref)
        for got, want in zip(cache.layers, ref.layers, strict=True):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
        crop_cache(cache, 9)
        assert cache_length(cache) == 9
        torch.testing.assert_close(cache.layers[0].keys, ref.layers[0].keys[..., :9, :])
