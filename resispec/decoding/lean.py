"""The lean speculative step: the reference step of `engine.py` minus the host work that is not a model forward.

Same contract, same tree, same rules; what it does not do (measured on CPU, where every torch call costs a few
microseconds whatever its size, so the number of calls is the cost):
- verify whole tree levels: only the nodes the walk reaches are verified, so a rejection at depth 1 costs one rule
  call, and the per-node work of the rule (resispec's ratio sort and T* solve) is done for D nodes at most instead
  of every node of every level reached. Below a branching node the walk's next node is known only after its
  verification, but along a chain it is not: a run of nodes with one child each (a chain, or the tail of a
  [4, 2, 1, 1] tree) is verified in ONE batched rule call and one host sync (`chain_from`);
- compute the target distribution of every node: p is built only for the nodes on the walk, lazily;
- run the sampling transform or the rule at temperature 0: greedy drafting takes the top-b draft LOGITS (softmax
  is monotone) and the accept walk is one argmax over all nodes plus a walk over Python dicts (one host sync);
Exactness: each node on the path is verified with fresh randomness exactly as the sequential definition of the
walk (DESIGN.md "Accept phase"); nodes off the path are never verified, which is what the reference's discarded
rows amount to. Greedy output is token-identical to the reference step and to target greedy decoding (tested).
"""

from __future__ import annotations

import time

import torch

from resispec.decoding.kv_cache import (
    cache_length,
    compact_to_path,
    forward_logits,
    new_cache,
    tree_attention_mask,
)
from resispec.decoding.stats import DecodeStats
from resispec.decoding.tree import DraftTree
from resispec.sampling import SeedStream, is_greedy, row_uniforms, sample_at, sample_each
from resispec.verify.base import Proposal
from resispec.verify.iid import verify_one_draw
from resispec.verify.registry import VERIFIERS


@torch.inference_mode()
def lean_spec_steps(
    dec, prompt: list[int], settings: dict, generator, stats: DecodeStats, max_new_tokens: int
):
    """Speculative steps of `dec` (a SpeculativeDecoder); yields each step's emitted run. See the module docstring."""
    dev, rule, shape = dec.device, row_rule(dec.rule, generator), dec.shape
    depth_max = len(shape)
    greedy = is_greedy(settings["temperature"]) and dec.greedy_topk
    vocab = dec.vocab_size
    tcache = dec._prefill_target(prompt, stats)
    dcache = new_cache(dec.draft)
    t_dtype, d_dtype = dec.target.dtype, dec.draft.dtype
    num_committed = len(prompt)
    pending = list(prompt)
    root = prompt[-1]
    committed = list(prompt)
    remaining = max_new_tokens
    while True:
        # ---- draft phase: one forward per depth
        dec._sync()
        t0 = time.perf_counter()
        tree = DraftTree(root, dec.max_nodes)
        proposals = []
        fed_depth = 0
        depth_lim = min(depth_max, remaining - 1)
        if depth_lim > 0:
            start = cache_length(dcache)
            pos = torch.arange(start, start + len(pending), device=dev)[None]  # [1, P]
            ids = torch.tensor([pending], device=dev)
            logits = dec._draft_forward(stats, ids, dcache, pos, logits_to_keep=1)[0, :, :vocab]  # [1, V]
            for depth in range(1, depth_lim + 1):
                width = shape[depth - 1]
                if greedy:  # top-b of the draft's logits = top-b of its softmax
                    draws = torch.topk(logits, min(width, vocab), dim=-1).indices.tolist()
                else:
                    q = dec._probs(logits, settings)
                    proposal = propose_at(rule, q, width, generator, num_committed - 1 + depth)
                    proposals.append(proposal)
                    draws = proposal.token_ids.tolist()
                level = tree.add_level(draws)
                if len(level) == 0:
                    if proposals:
                        proposals.pop()
                    break
                if depth == depth_lim:
                    break
                block = tree.mask(level, range(1, level.stop))  # [n_d, nodes so far]
                mask = tree_attention_mask(num_committed, block.to(dev), d_dtype)
                ids = torch.tensor([tree.tokens[level.start : level.stop]], device=dev)
                pos = torch.full((1, len(level)), num_committed - 1 + depth, device=dev)
                logits = dec._draft_forward(stats, ids, dcache, pos, mask)[0, :, :vocab]  # [n_d, V]
                fed_depth = depth
        dec._sync()
        t1 = time.perf_counter()
        stats.draft_seconds += t1 - t0
        stats.draft_forwards += 1 + fed_depth if depth_lim > 0 else 0
        depth_eff = tree.depth

        # ---- verify phase: ONE target forward over the root and every node
        num_nodes = tree.num_nodes
        all_nodes = range(0, num_nodes)
        mask = tree_attention_mask(num_committed - 1, tree.mask(all_nodes, all_nodes).to(dev), t_dtype)
        ids = torch.tensor([tree.tokens], device=dev)
        pos = torch.tensor([tree.depths], device=dev) + (num_committed - 1)
        logits = forward_logits(dec._target_fwd, ids, tcache, pos, mask)[0, :, :vocab]  # [N+1, V]
        if greedy:
            best = logits.argmax(dim=-1).tolist()  # the one host sync of a greedy step
        dec._sync()
        t2 = time.perf_counter()
        stats.target_seconds += t2 - t1
        stats.target_forwards += 1

        # ---- accept phase
        if greedy:
            run, accepted = walk_greedy(tree, best)
        else:

            def p_at(nodes: list[int], logits: torch.Tensor = logits) -> torch.Tensor:
                return dec._probs(logits[nodes], settings)  # [len(nodes), V]

            run, accepted = walk_sampled(rule, tree, p_at, proposals, generator, num_committed)
        stats.accept_seconds += time.perf_counter() - t2

        num_acc = len(accepted)
        stats.record_step(num_nodes, num_acc, depth_eff)
        yield run

        pending = advance_caches(
            tcache, dcache, num_committed, tree, accepted, fed_depth, depth_lim > 0, pending, run
        )
        remaining -= len(run)
        num_committed += num_acc + 1
        root = run[-1]
        if dec.after_step is not None:
            committed.extend(run)
            dec.after_step(tcache, dcache, committed)


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
    """After a step (both step paths): compact both caches to the accepted path; returns the tokens the draft is
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
