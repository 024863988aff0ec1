"""Draft tree bookkeeping for one decoding step (batch 1).

Nodes are stored in breadth-first order; node 0 is the root (the last committed token), depth d occupies
`level_starts[d]:level_starts[d+1]`. Repeated i.i.d. draws of one node share one child node. `ancestors[i, j]`
is True when node j is node i or one of its ancestors: that is the tree attention mask. It is a numpy array
(each level's update is a few index ops, a microsecond each where torch's cost several); `mask` hands out torch
views of it.
"""

from __future__ import annotations

import numpy as np
import torch


def parse_tree(tree: list[int] | tuple[int, ...]) -> list[int]:
    """Validate a tree shape given as branching per depth ([1]*k is a chain)."""
    shape = [int(b) for b in tree]
    if not shape or any(b < 1 for b in shape):
        raise ValueError(f"tree must be a non-empty list of positive branching factors, got {tree!r}")
    return shape


def max_tree_nodes(shape: list[int]) -> int:
    """Upper bound on non-root nodes (no repeated draws): sum over depths of the product of branchings."""
    total, width = 0, 1
    for b in shape:
        width *= b
        total += width
    return total


class DraftTree:
    """The tree of one step: tokens, parents, depth levels, token->child maps and the ancestor mask."""

    def __init__(self, root_token: int, max_nodes: int) -> None:
        self.tokens: list[int] = [root_token]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]
        self.level_starts: list[int] = [0, 1]
        self.ancestors = np.zeros((max_nodes + 1, max_nodes + 1), dtype=bool)  # [N+1, N+1]
        self.ancestors[0, 0] = True

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """Deepest level built so far."""
        return len(self.level_starts) - 2

    def level(self, depth: int) -> range:
        return range(self.level_starts[depth], self.level_starts[depth + 1])

    def add_level(self, draws: list[list[int]]) -> range:
        """Add the children of the deepest level; `draws[i]` = draws of its i-th node in draw order."""
        parents = self.level(self.depth)
        assert len(draws) == len(parents), (len(draws), len(parents))
        new_parents: list[int] = []
        for parent, node_draws in zip(parents, draws, strict=True):
            kids = self.children[parent]
            for tok in node_draws:
                if tok >= 0 and tok not in kids:  # -1 = empty slot; repeated i.i.d. draws share one child
                    kids[tok] = len(self.tokens)
                    self.tokens.append(tok)
                    self.parents.append(parent)
                    self.depths.append(self.depth + 1)
                    self.children.append({})
                    new_parents.append(parent)
        start, end = self.level_starts[-1], len(self.tokens)
        if end == start:  # no child anywhere (every slot empty): the tree stops one level up
            return range(start, end)
        self.level_starts.append(end)
        idx = np.arange(start, end)
        self.ancestors[start:end] = self.ancestors[new_parents]
        self.ancestors[idx, idx] = True
        return range(start, end)

    def mask(self, rows: range, cols: range) -> torch.Tensor:
        """Block of the ancestor mask [len(rows), len(cols)], a CPU torch view (shares memory with the tree)."""
        return torch.from_numpy(self.ancestors[rows.start : rows.stop, cols.start : cols.stop])

    def path_to(self, node: int) -> list[int]:
        """Non-root nodes from depth 1 down to `node` (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
