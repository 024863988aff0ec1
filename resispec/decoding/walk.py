"""The accept walk and the rule helpers every speculative step uses (SpeculativeDecoder's step in engine.py, the
batched step in batch_spec.py): which rule a row runs, its draws at one level, the walk from the root, and the
caches' advance to the accepted path.

What the walk does not do (on CPU every torch call costs a few microseconds whatever its size, so the number of
calls is the cost):
- verify whole tree levels: only the nodes the walk reaches are verified, so a rejection at depth 1 costs one rule
  call, and the per-node work of the rule (resispec's ratio sort and T* solve) is done for D nodes at most instead
  of every node of every level reached. Below a branching node the walk's next node is known only after its
  verification, but along a chain it is not: a run of nodes with one child each (a chain, or the tail of a
  [4, 2, 1, 1] tree) is verified in ONE batched rule call and one host sync (`chain_from`);
- compute the target distribution of every node: p is built only for the nodes on the walk, lazily;
- run the sampling transform or the rule at temperature 0: greedy drafting takes the top-b draft LOGITS (softmax
  is monotone) and the accept walk is one argmax over all nodes plus a walk over Python dicts (one host sync).
Exactness: each node on the path is verified with fresh randomness exactly as the sequential definition of the
walk (docs/design.md "Accept phase"); nodes off the path are never verified, which is what verifying whole levels and
discarding the rows off the path amounts to (the reference step, tests/oracle_decoder.py). Greedy output is
token-identical to the reference step and to target greedy decoding (tested).
"""

from __future__ import annotations

import torch

from resispec.decoding.kv_cache import compact_to_path
from resispec.decoding.tree import DraftTree
from resispec.sampling import SeedStream, row_uniforms, sample_at, sample_each
from resispec.verify.base import Proposal
from resispec.verify.iid import verify_one_draw
from resispec.verify.registry import VERIFIERS

# the temperature-0 rule (resispec/verify/greedy.py): top-b drafting, argmax verification
GREEDY = VERIFIERS["greedy"]


def resolve_rule(rule):
    """A rule name (key of resispec.verify.VERIFIERS) or any object with scheme/propose/verify."""
    if not isinstance(rule, str):
        return rule
    if rule not in VERIFIERS:
        raise KeyError(f"unknown verification rule {rule!r}; known: {sorted(VERIFIERS)}")
    return VERIFIERS[rule]


def advance_caches(
    tcache,
    dcache,
    num_committed: int,
    tree: DraftTree,
    accepted: list[int],
    fed_depth: int,
    drafted: bool,
    pending: list[int],
    run: list[int],
) -> list[int]:
    """After a batch-1 step: compact both caches to the accepted path; returns the tokens the draft is
    fed first next step. `fed_depth`: the deepest tree level the draft's cache holds; `drafted`: the step drafted."""
    compact_to_path(tcache, num_committed - 1, [0] + accepted)
    if not drafted:  # no draft this step (only the emit budget's last token): the draft still owes `pending`
        return pending + [run[-1]]
    compact_to_path(dcache, num_committed, [n - 1 for n in accepted if tree.depths[n] <= fed_depth])
    # an accepted node deeper than the draft has seen (at most the last one) is fed next step
    return [tree.tokens[n] for n in accepted if tree.depths[n] > fed_depth] + [run[-1]]


def row_rule(rule, generator):
    """The rule a sampled row verifies with: `gumbel` for a seeded row (a SeedStream: drafter-invariant
    sampling, resispec.sampling.SeedStream), else the decoder's rule."""
    return VERIFIERS["gumbel"] if isinstance(generator, SeedStream) else rule


def propose_at(rule, q: torch.Tensor, n: int, generator, position: int):
    """The children of the nodes of one level (q [nodes, V]), tokens at absolute `position`: a seeded row drafts
    the Gumbel-top-n of log q + G_position (row_rule's gumbel), any other the rule's own draws (a greedy row's
    rule draws the top-n of q whatever its generator)."""
    if isinstance(generator, SeedStream) and rule is VERIFIERS["gumbel"]:
        return VERIFIERS["gumbel"].propose(q, n, noise=generator.gumbel(position, q))
    return rule.propose(q, n, generator)


def walk_greedy(tree: DraftTree, best: list[int]) -> tuple[list[int], list[int]]:
    """Temperature 0: from the root, emit argmax p; continue while it is a child. best[i] = argmax p at node i."""
    node, run, accepted = 0, [], []
    while True:
        tok = best[node]
        run.append(tok)
        child = tree.children[node].get(tok)
        if child is None:  # a correction (rejected) or, at a leaf, the bonus token
            return run, accepted
        accepted.append(child)
        node = child


def walk_sampled(
    rule, tree: DraftTree, p_at, proposals: list, generator, position: int = 0
) -> tuple[list[int], list[int]]:
    """Verify only the nodes the walk reaches (module docstring), a chain of them in one call (`chain_from`).
    p_at(nodes) -> [len(nodes), V]: the target distribution at those nodes; position: the absolute position of
    the root's children (a SeedStream's bonus token is keyed by its position). Returns (emitted run, accepted node
    ids)."""
    node, run, accepted = 0, [], []
    while tree.depths[node] < tree.depth:
        nodes = chain_from(tree, proposals, node)
        parts = [proposals[tree.depths[v]].select(v - tree.level_starts[tree.depths[v]]) for v in nodes]
        proposal = parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)
        token, slot = rule.verify(p_at(nodes), proposal, generator)
        tokens, hits = torch.stack([token, slot]).tolist()  # one host sync for the chain
        for v, tok, hit in zip(nodes, tokens, hits, strict=True):
            run.append(tok)
            if hit < 0:  # rejected: `tok` is the correction token (the rows below were verified for nothing)
                return run, accepted
            node = tree.children[v].get(tok)
            if node is None:
                raise RuntimeError(f"rule accepted token {tok} that is not a child of node {v}")
            accepted.append(node)
    leaf_p = p_at([node])  # [1, V]
    run.append(int(sample_at(leaf_p, generator, position + len(accepted)).item()))
    return run, accepted


def walk_one_draw_chains(
    p: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor | None, generators: list
) -> list[tuple[list[int], list[int]]]:
    """walk_sampled for a batch of G rows that each drafted a chain of D one-draw nodes with a rule whose one-draw
    step is standard speculative sampling (`one_draw_is_standard`: chain, rrs, kseq, resispec), all rows verified
    in a handful of batched ops instead of ~15 per row. Each row's uniforms come from its own generator in
    walk_sampled's order (the chain's acceptance tests, its residual draws, then the bonus token where all D were
    accepted: sampling.row_uniforms), and rows are computed independently, so a row emits the tokens walk_sampled
    emits for it with the same seed.
    p [G, D + 1, V]: the target's probabilities at the root and the D nodes; drafted [G, D]: the chain's tokens;
    q [G, D, V]: the draft distributions they were drawn from. D = 0 (q None): rows that did not draft sample p at
    their root. -> per row (emitted run, accepted node ids), node d being the chain's node at depth d."""
    rows, depth, vocab = p.shape[0], p.shape[1] - 1, p.shape[2]
    runs: list[list[int]] = [[] for _ in range(rows)]
    accepted: list[list[int]] = [[] for _ in range(rows)]
    if depth:
        u_accept = row_uniforms(generators, (depth, 1), p)
        u_residual = row_uniforms(generators, (depth, 1), p)
        proposal = Proposal(token_ids=drafted.reshape(-1, 1), q=q.reshape(-1, vocab))
        token, slot = verify_one_draw(p[:, :depth].reshape(-1, vocab), proposal, None, (u_accept, u_residual))
        tokens, hits = torch.stack([token, slot]).view(2, rows, depth).tolist()  # one host sync
        for i in range(rows):
            for d in range(depth):
                runs[i].append(tokens[i][d])
                if hits[i][d] < 0:  # rejected: the correction token ends the run
                    break
                accepted[i].append(d + 1)
    full = [i for i in range(rows) if len(accepted[i]) == depth]  # every node accepted: the bonus token
    if full:
        bonus = sample_each(p[full, depth], [generators[i] for i in full]).tolist()
        for i, tok in zip(full, bonus, strict=True):
            runs[i].append(tok)
    return list(zip(runs, accepted, strict=True))


def chain_from(tree: DraftTree, proposals: list, node: int) -> list[int]:
    """The nodes the walk verifies in one rule call from `node` on: `node`, then while the last one has exactly one
    child that is not a leaf and drafted as many draws, that child. If every node of the run but the last accepts,
    the walk reaches each of them in turn, so they are verified together (independent rows, fresh randomness each:
    the law of the sequential walk); the rows past a rejection are discarded. [node] alone where `node` branches."""
    nodes = [node]
    draws = proposals[tree.depths[node]].num_draws
    while len(tree.children[nodes[-1]]) == 1:
        child = next(iter(tree.children[nodes[-1]].values()))
        depth = tree.depths[child]
        if depth >= tree.depth or proposals[depth].num_draws != draws:
            break
        nodes.append(child)
    return nodes
