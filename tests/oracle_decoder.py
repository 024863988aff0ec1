"""The exactness oracle: the reference speculative step, the readable form of the step SpeculativeDecoder runs
(resispec/decoding/engine.py). It verifies whole tree levels with one batched rule call each (the rows off the walked
path use their own randomness and are discarded) and builds the target distribution of every node; the product step
verifies only the nodes the walk reaches. Same tokens at temperature 0 (with greedy_topk, every exact rule is argmax
matching; tested), same law otherwise (tests/unit/test_decoding_exactness.py runs both).

    dec = ReferenceDecoder(target, draft, rule="rrs", tree=[3, 2, 1])   # SpeculativeDecoder's arguments
    dec.generate(...), dec.generate_stream(...)                          # the same API, the reference step
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from resispec.decoding import SpeculativeDecoder
from resispec.decoding.kv_cache import cache_length, forward_logits, new_cache, tree_attention_mask
from resispec.decoding.tree import DraftTree
from resispec.decoding.walk import GREEDY, advance_caches, propose_at, row_rule
from resispec.sampling import is_greedy, sample_at


def decoder(target, draft, reference: bool = False, **kwargs) -> SpeculativeDecoder:
    """SpeculativeDecoder(target, draft, **kwargs), or with `reference` the oracle (the tests' lean/reference flag)."""
    return (ReferenceDecoder if reference else SpeculativeDecoder)(target, draft, **kwargs)


class ReferenceDecoder(SpeculativeDecoder):
    """SpeculativeDecoder with the reference speculative step (module docstring); AR and the plumbing unchanged."""

    @torch.inference_mode()
    def _spec_steps(self, prompt, settings, generator, stats, max_new_tokens) -> Iterator[list[int]]:
        dev, rule, shape = self.device, row_rule(self.rule, generator), self.shape
        depth_max = len(shape)
        greedy = is_greedy(settings["temperature"])
        q_settings = settings
        if greedy and self.greedy_topk:
            # temperature 0: every exact rule reduces to "emit argmax p; accepted iff it is a child", so the best tree
            # drafts each node's top-b draft tokens (ranked by the draft's softmax) and skips the rule's arithmetic
            rule, q_settings = GREEDY, dict(temperature=1.0, top_k=0, top_p=1.0)
        tcache = self._prefill_target(prompt, stats)
        dcache = new_cache(self.draft)
        mask_dtype = self.target.dtype
        draft_mask_dtype = self.draft.dtype
        num_committed = len(prompt)  # L; the root prompt[-1] is the last committed token
        pending = list(prompt)  # committed tokens not yet in the draft cache (the draft prefill is folded in)
        root = prompt[-1]
        committed = list(prompt)  # only kept up to date for the after_step hook
        remaining = max_new_tokens
        while True:
            # ---- draft phase: one forward per depth
            self._sync()
            t0 = time.perf_counter()
            tree = DraftTree(root, self.max_nodes)
            proposals = []
            fed_depth = 0  # deepest level the draft has processed (its cache holds levels 1..fed_depth)
            # never draft deeper than can be emitted: with r tokens left, r - 1 drafts plus the bonus token
            depth_lim = min(depth_max, remaining - 1)
            if depth_lim > 0:
                start = cache_length(dcache)
                pos = torch.arange(start, start + len(pending), device=dev)[None]  # [1, P]
                ids = torch.tensor([pending], device=dev)
                logits = self._draft_forward(stats, ids, dcache, pos, logits_to_keep=1)  # [1, 1, V]
                q = self._probs(logits[0], q_settings)  # [1, V]
                for depth in range(1, depth_lim + 1):
                    proposal = propose_at(rule, q, shape[depth - 1], generator, num_committed - 1 + depth)
                    level = tree.add_level(proposal.token_ids.tolist())  # one host sync per depth
                    if len(level) == 0:
                        break
                    proposals.append(proposal)
                    if depth == depth_lim:
                        break
                    block = tree.mask(level, range(1, level.stop)).to(dev)  # [n_d, nodes so far]
                    mask = tree_attention_mask(num_committed, block, draft_mask_dtype)
                    ids = torch.tensor([tree.tokens[level.start : level.stop]], device=dev)
                    pos = torch.full((1, len(level)), num_committed - 1 + depth, device=dev)
                    logits = self._draft_forward(stats, ids, dcache, pos, mask)  # [1, n_d, V]
                    q = self._probs(logits[0], q_settings)  # [n_d, V]
                    fed_depth = depth
            self._sync()
            t1 = time.perf_counter()
            stats.draft_seconds += t1 - t0
            stats.draft_forwards += 1 + fed_depth if depth_lim > 0 else 0
            depth_eff = tree.depth  # < depth_max only when a whole level had no draws

            # ---- verify phase: ONE target forward over the root and every node
            num_nodes = tree.num_nodes
            all_nodes = range(0, num_nodes)
            mask = tree_attention_mask(num_committed - 1, tree.mask(all_nodes, all_nodes).to(dev), mask_dtype)
            ids = torch.tensor([tree.tokens], device=dev)
            pos = torch.tensor([tree.depths], device=dev) + (num_committed - 1)
            logits = forward_logits(self._target_fwd, ids, tcache, pos, mask)  # [1, N+1, V]
            p = self._probs(logits[0], settings)  # [N+1, V]
            self._sync()
            t2 = time.perf_counter()
            stats.target_seconds += t2 - t1
            stats.target_forwards += 1

            # ---- accept phase: walk from the root, verifying a level only when the walk reaches it
            run, accepted = self._walk(rule, tree, p, proposals, generator, greedy, num_committed)
            stats.accept_seconds += time.perf_counter() - t2

            num_acc = len(accepted)
            stats.record_step(num_nodes, num_acc, depth_eff)
            yield run  # the consumer closes this generator at a stop, so no cache work is wasted after it

            # ---- compact both caches to the accepted path
            pending = advance_caches(
                tcache, dcache, num_committed, tree, accepted, fed_depth, depth_lim > 0, pending, run
            )
            remaining -= len(run)
            num_committed += num_acc + 1
            root = run[-1]
            if self.after_step is not None:
                committed.extend(run)
                self.after_step(tcache, dcache, committed)

    @staticmethod
    def _walk(
        rule, tree: DraftTree, p: torch.Tensor, proposals: list, generator, greedy: bool, position: int
    ):
        """Follow the verified path from the root -> (emitted run, accepted node ids).

        p [N+1, V] is the target distribution at every node. The rule verifies a whole level in one batched call
        (the rows off the path use their own randomness and are ignored, which keeps the path exact); levels past
        the first rejection are never verified. One host sync per level reached. position: the absolute position
        of the root's children (a SeedStream's bonus token is keyed by its position)."""
        node, run, accepted = 0, [], []
        for depth in range(1, tree.depth + 1):
            parents = tree.level(depth - 1)
            token, slot = rule.verify(p[parents.start : parents.stop], proposals[depth - 1], generator)
            i = node - parents.start
            tok, hit = torch.stack([token[i], slot[i]]).tolist()
            run.append(tok)
            if hit < 0:  # rejected: `tok` is the correction token
                return run, accepted
            child = tree.children[node].get(tok)
            if child is None:
                raise RuntimeError(f"rule accepted token {tok} that is not a child of node {node}")
            node = child
            accepted.append(node)
        # every draft on the path was accepted: the bonus token comes from p at the leaf
        leaf_p = p[node : node + 1]  # [1, V]
        bonus = leaf_p.argmax(dim=-1) if greedy else sample_at(leaf_p, generator, position + len(accepted))
        run.append(int(bonus.item()))
        return run, accepted
