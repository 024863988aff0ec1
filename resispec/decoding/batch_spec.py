"""Batched exact speculative decoding (docs/design.md "Batched decoding and scheduling"): per-row draft trees, one draft
forward per depth and ONE target forward per step for all rows, per-row acceptance with the rule, per-row
bookkeeping. The rows, their join and their leaving are RowBatch's (resispec/decoding/batch_rows.py); the walks are
resispec/decoding/walk.py's, the ones the batch-1 step runs.

  step(draft)  _draft (every row's tree: one draft forward over the rows' pending tokens, then one per depth),
               _verify (ONE target forward over every row's tree), _walk_chains (the one-draw chains' walks in
               batched ops), _accept (every other row's walk, then both caches compacted). With no row drafting, the
               step is an autoregressive one (_ar_step).

Caches: each model's batch cache is a _HoleyCache, whose rows may have holes (the rejected tree nodes); a row's
valid columns in column order are its tokens in order. Exactness: each row consumes its own generator in the order
SpeculativeDecoder consumes it alone, so a seeded row's tokens do not depend on its neighbours, and a greedy row
equals the target's greedy decoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from resispec.decoding.batch_rows import BatchRow, RowBatch, additive_mask, left_padded
from resispec.decoding.fast_forward import fast_forward
from resispec.decoding.head_draft import join_pending, pending_after, root_block, target_forward
from resispec.decoding.kv_cache import (
    crop_cache,
    forward_logits,
    gather_cache_columns,
    merge_cache_row,
    new_cache,
    select_cache_rows,
    trim_cache_left,
)
from resispec.decoding.prefix_cache import PrefixCache
from resispec.decoding.tree import DraftTree, max_tree_nodes, parse_tree
from resispec.decoding.vocab import resolve_vocab_size
from resispec.decoding.walk import (
    GREEDY,
    propose_at,
    resolve_rule,
    row_rule,
    walk_greedy,
    walk_one_draw_chains,
    walk_sampled,
)
from resispec.models.head import is_head
from resispec.sampling import SeedStream, probs_by_settings, sample_each
from resispec.sampling import probs as process_logits
from resispec.verify.base import top_set


class _HoleyCache:
    """A batch cache whose rows may have holes: `valid` [B, T] marks the columns each row attends to. Tree nodes
    are appended for every row and only the accepted ones become valid (keys carry their RoPE positions, so a
    row's valid columns in any order ARE its sequence); padding queries of shorter rows are never valid.
    Columns no row uses are cropped, and the cache is repacked right-aligned when holes outweigh tokens."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache = new_cache(model)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=next(model.parameters()).device)

    @property
    def num_cols(self) -> int:
        return self.valid.shape[1]

    def add_row(self, row_cache, length: int) -> None:
        """Merge a batch-1 cache holding `length` tokens as a new row (right-aligned)."""
        merge_cache_row(self.cache, self.valid.shape[0], row_cache)
        width = max(self.num_cols, length)
        old = torch.cat([self.valid.new_zeros(self.valid.shape[0], width - self.num_cols), self.valid], 1)
        new = torch.arange(width, device=self.valid.device) >= width - length
        self.valid = torch.cat([old, new[None]])

    def keep_rows(self, rows: torch.Tensor) -> None:
        select_cache_rows(self.cache, rows)
        self.valid = self.valid.index_select(0, rows)
        self.compact()

    def append(self, new_valid: torch.Tensor) -> None:
        """Record the columns the last forward appended ([B, Q])."""
        self.valid = torch.cat([self.valid, new_valid], 1)

    def allowed(self, num_new: int) -> torch.Tensor:
        """[B, Q, T + Q] bool: cached valid columns for every query; the new block is left False (caller fills)."""
        b = self.valid.shape[0]
        out = torch.zeros(b, num_new, self.num_cols + num_new, dtype=torch.bool, device=self.valid.device)
        out[:, :, : self.num_cols] = self.valid[:, None, :]
        return out

    def compact(self) -> None:
        """Drop columns no row uses at either end; repack right-aligned when holes exceed the tokens."""
        if self.valid.shape[0] == 0:
            self.cache, self.valid = new_cache(self.model), self.valid[:, :0]
            return
        used = self.valid.any(0).nonzero()
        if used.numel() == 0:
            first, last = self.num_cols, self.num_cols
        else:
            first, last = int(used[0]), int(used[-1]) + 1
        if last < self.num_cols:
            crop_cache(self.cache, last)
            self.valid = self.valid[:, :last]
        if first > 0:
            trim_cache_left(self.cache, first)
            self.valid = self.valid[:, first:]
        if self.num_cols == 0:  # nothing left: start over (a zero-length layer would keep a stale batch size)
            self.cache = new_cache(self.model)
            return
        counts = self.valid.sum(1)
        width = int(counts.max()) if counts.numel() else 0
        if self.num_cols > 2 * width + 16:
            # stable sort puts each row's holes first and its valid columns (in order) last
            order = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, -width:] if width else None
            if order is None:
                self.cache, self.valid = new_cache(self.model), self.valid[:, :0]
                return
            gather_cache_columns(self.cache, order)
            self.valid = self.valid.gather(1, order)


def _is_tree(flag) -> bool:
    """A per-depth branching such as (2, 1) or [4, 2, 1, 1] (not a list of per-row flags)."""
    return (
        isinstance(flag, (tuple, list))
        and len(flag) > 0
        and all(isinstance(b, int) and not isinstance(b, bool) for b in flag)
    )


@dataclass
class _DraftedStep:
    """One speculative step's trees, per row, and what their walks need of the drafting."""

    trees: list  # [DraftTree]
    rules: list  # the rule each row's walk runs (the registry's greedy rule for greedy rows)
    greedy: list[bool]  # greedy rows: top-n children, walk_greedy
    chain: list[bool]  # rows whose draws and walk are batched (walk_one_draw_chains)
    chain_q: list[list[torch.Tensor]]  # those rows' q [1, V] per depth
    proposals: list[list]  # the other sampled rows' proposals, per depth
    fed: list[int]  # deepest tree level each row's draft has processed
    node_col: list[dict[int, int]]  # tree node -> draft cache column, this step
    q_settings: list[dict]  # the settings each row's q is computed with (greedy rows: the plain softmax)
    states: list = None  # a draft head: each row's pre-norm outputs [n, H] at its last level fed
    level_start: list = None  # ... and that level's first node


class BatchedSpeculativeDecoder(RowBatch):
    """Batched exact speculative decoding: per-row draft trees, one draft forward per depth and ONE target forward
    per step for all rows, per-row acceptance with the rule (greedy rows: the registry's greedy rule), per-row
    bookkeeping.

    The row API of RowBatch (add / add_many / prefill_part / step / remove / generate). Each row consumes its own
    generator in the same order as SpeculativeDecoder does alone (propose depth 1..D, then the verification walk),
    so a seeded row's output does not depend on its neighbours, and a greedy row equals the target's greedy
    decoding. forward / draft_forward: the models' forwards (default the decoder's own fast forward)."""

    def __init__(
        self,
        target,
        draft,
        rule="resispec",
        tree: Sequence[int] = (2, 1),
        tokenizer=None,
        vocab_size: int | None = None,
        greedy_topk: bool = True,
        forward: Callable | None = None,
        draft_forward: Callable | None = None,
    ) -> None:
        self.head = draft if is_head(draft) else None  # a draft head (resispec/decoding/head_draft.py)
        super().__init__(
            target,
            tokenizer,
            vocab_size or resolve_vocab_size(target, target if self.head else draft, tokenizer),
            forward,
        )
        self.draft = draft.eval()
        self.rule = resolve_rule(rule)
        self.shape = parse_tree(list(tree))
        self.max_nodes = max_tree_nodes(self.shape)
        self.greedy_topk = greedy_topk
        # a head's is a FastHead (or the head): its step, fuse and logits
        self._d_fwd = draft_forward if draft_forward is not None else fast_forward(draft)
        self._d_dtype = draft.dtype  # read once: .dtype walks the parameters
        self.tcache, self.dcache = _HoleyCache(target), _HoleyCache(draft)
        # prefill the draft when a row joins (_join); off for a batch that never drafts
        self.prefill_draft = (
            self.head is None
        )  # a head reads the target's states: no prompt prefill of its own
        self.draft_prefix: PrefixCache | None = None  # stored prompt K/V of the draft (enable_prefix_cache)

    @classmethod
    def from_decoder(cls, decoder) -> BatchedSpeculativeDecoder:
        """The batched speculative path of a `SpeculativeDecoder` (same pair, rule, tree, vocabulary, forwards)."""
        return cls(
            decoder.target,
            decoder.draft,
            decoder.rule,
            decoder.shape,
            decoder.tokenizer,
            decoder.vocab_size,
            decoder.greedy_topk,
            forward=decoder.target_forward,
            draft_forward=decoder.draft_forward,
        )

    @property
    def draft_forward(self) -> Callable:
        """The draft's forward the batch runs."""
        return self._d_fwd

    def enable_prefix_cache(self, max_tokens: int) -> None:
        """RowBatch.enable_prefix_cache, for the target and the draft (each its own `max_tokens`)."""
        super().enable_prefix_cache(max_tokens)
        self.draft_prefix = PrefixCache(max_tokens) if self.prefix is not None else None

    def _prefill_models(self) -> list:
        models = [("target", self._target_fwd, self.target, self.prefix)]
        if self.prefill_draft:
            models.append(("draft", self._d_fwd, self.draft, self.draft_prefix))
        return models

    def _join(self, rows: list[BatchRow]) -> None:
        """The new rows join both caches, each prefilled by one forward over all their prompts. The draft is
        prefilled here on the prompt but its last token (as the target): folded into the next drafting step
        instead, the prompt would be a block that every other row is padded to (at 16 rows and 65-token prompts, a
        draft forward over ~1000 positions in the step of each newcomer). Without `prefill_draft` (a batch that
        never drafts) the prompt waits in the row's `pending`, the tokens the draft has not seen, and a drafting
        step takes them all."""
        caches = self._prefill_rows(rows)
        tcaches, dcaches = caches["target"], caches.get("draft")
        for b, row in enumerate(rows):
            self.tcache.add_row(tcaches[b], row.length)
            if self.head is not None:  # the head's pairs of the prompt (head_draft.join_pending)
                self.dcache.add_row(new_cache(self.draft), 0)
                row.pending = join_pending(
                    self._target_fwd, self.target, self.head.layers, row.prompt, self.device
                )
            elif dcaches is None:
                self.dcache.add_row(new_cache(self.draft), 0)
                row.pending = list(row.prompt)  # committed tokens not yet in the draft cache
            else:
                self.dcache.add_row(dcaches[b], row.length)
                row.pending = row.prompt[-1:]
            row.stats.accepted_per_position = [0] * len(self.shape)
            row.stats.reached_per_position = [0] * len(self.shape)
            self.rows.append(row)

    def _target_cache(self):
        return self.tcache.cache

    def _row_columns(self, b: int, row: BatchRow) -> torch.Tensor:
        # a row's valid columns, in column order, are its tokens in order (tree levels are appended by depth)
        return self.tcache.valid[b].nonzero().squeeze(1)

    def _keep_cache_rows(self, sel: torch.Tensor) -> None:
        self.tcache.keep_rows(sel)
        self.dcache.keep_rows(sel)

    def reset(self) -> None:
        self.rows = []
        self.tcache, self.dcache = _HoleyCache(self.target), _HoleyCache(self.draft)

    @property
    def kv_tokens(self) -> int:
        return len(self.rows) * (self.tcache.num_cols + self.dcache.num_cols)

    @property
    def in_lockstep(self) -> bool:
        """Every row attends to all the target cache's columns but at most one (no hole, at most one token of
        padding): rows of one length, as equal requests admitted together stay under autoregressive steps (up to
        one step, for a request that reached the server a step later)."""
        valid = self.tcache.valid
        return valid.shape[0] == 0 or int(valid.sum(1).min()) >= valid.shape[1] - 1

    def _probs(self, logits: torch.Tensor, settings: dict) -> torch.Tensor:
        return process_logits(logits[..., : self.vocab_size], **settings)

    @torch.inference_mode()
    def step(self, draft: bool | Sequence[bool] = True) -> list[tuple[BatchRow, list[int]]]:
        """One speculative step for every row -> [(row, its emitted tokens)]; finished rows leave the batch.

        draft: one entry for all rows or one per row: True drafts the decoder's tree, False takes a plain
        autoregressive step (a one-token verify), a tree (per-depth branching, e.g. (2, 1)) drafts that tree this
        step. When no row drafts, the step is an autoregressive one (`_ar_step`: no draft forward, trees or walks)
        and the tokens the draft has not seen pile up in each row's `pending`, fed with the next drafting step. So
        the caller can switch speculation off and on, or change the tree, between steps (by load) without leaving
        exactness: every step is an exact step of its own tree."""
        rows = self.rows
        if not rows:
            return []
        t0 = time.perf_counter()
        flags = [draft] * len(rows) if isinstance(draft, bool) or _is_tree(draft) else list(draft)
        shapes = [self.shape if f is True else parse_tree(list(f)) if f else [] for f in flags]
        lims = [
            min(len(sh), r.max_new_tokens - len(r.generated) - 1) for r, sh in zip(rows, shapes, strict=True)
        ]
        if self.head is not None:  # a head row with no target feature yet (a one-token prompt) cannot draft
            lims = [lim if len(r.pending) or r.length > 0 else 0 for r, lim in zip(rows, lims, strict=True)]
        if not any(
            lims
        ):  # the draft does not run this step (when it does, it takes every row's pending tokens)
            return self._ar_step(rows, flags, t0)
        step = self._draft(rows, shapes, lims)
        t1 = time.perf_counter()
        logits = self._verify(rows, step.trees)
        t2 = time.perf_counter()
        walks = self._walk_chains(rows, step, logits)
        return self._accept(rows, step, logits, walks, flags, (t0, t1, t2))

    # ------------------------------------------------------------------ the draft phase
    def _draft(self, rows: list[BatchRow], shapes: list[list[int]], lims: list[int]) -> _DraftedStep:
        """Every row's tree of this step: the draft's forward over each row's pending tokens (_draft_root), then
        per depth every row's children (_draw_level) and one forward over the levels that have children to draft
        (_feed_level)."""
        step = self._new_step(rows, shapes, lims)
        qs = self._draft_root(rows, step) if self.head is None else self._head_root(rows, step)
        growing = [lim > 0 for lim in lims]
        for depth in range(1, max(lims) + 1):
            feed = self._draw_level(rows, step, shapes, lims, qs, growing, depth)
            if not feed:
                break
            self._feed_level(rows, step, qs, feed, depth)
        return step

    def _new_step(self, rows: list[BatchRow], shapes: list[list[int]], lims: list[int]) -> _DraftedStep:
        """Each row's empty tree and rule, and which rows draw and walk in batched ops."""
        greedy = [r.greedy and self.greedy_topk for r in rows]
        rules = [GREEDY if g else row_rule(self.rule, r.generator) for r, g in zip(rows, greedy, strict=True)]
        return _DraftedStep(
            trees=[DraftTree(r.root, max_tree_nodes(sh)) for r, sh in zip(rows, shapes, strict=True)],
            rules=rules,
            greedy=greedy,
            # rows whose draws and walk are batched (walk_one_draw_chains): sampled and unseeded, drafting a chain
            # of one-draw nodes with a rule whose one-draw step is standard speculative sampling, or not drafting
            chain=[
                not g
                and not isinstance(r.generator, SeedStream)
                and (lim == 0 or (getattr(rule, "one_draw_is_standard", False) and set(sh[:lim]) == {1}))
                for r, g, rule, sh, lim in zip(rows, greedy, rules, shapes, lims, strict=True)
            ],
            chain_q=[[] for _ in rows],
            proposals=[[] for _ in rows],
            fed=[0] * len(rows),
            node_col=[{} for _ in rows],
            q_settings=[
                dict(temperature=1.0, top_k=0, top_p=1.0) if g else r.settings
                for r, g in zip(rows, greedy, strict=True)
            ],
        )

    def _draft_root(self, rows: list[BatchRow], step: _DraftedStep) -> list[torch.Tensor]:
        """Depth 0: the draft's forward over every row's pending committed tokens, LEFT-padded so that every row's
        last one is the block's last column and only that column goes through the LM head (a newcomer's prompt pads
        every other row to its length: full logits there cost more than the draft's layers) -> each row's q [1, V]
        at its root."""
        ids, pos, new_valid, block = left_padded(
            [r.pending for r in rows], [r.length + 1 - len(r.pending) for r in rows], self.device
        )
        allowed = self.dcache.allowed(ids.shape[1])
        allowed[:, :, self.dcache.num_cols :] = block
        logits = forward_logits(
            self._d_fwd, ids, self.dcache.cache, pos, additive_mask(allowed, self._d_dtype), logits_to_keep=1
        )
        self.dcache.append(new_valid)
        q_all = probs_by_settings(logits[:, -1, : self.vocab_size], step.q_settings)  # [B, V]
        return [q_all[b : b + 1] for b in range(len(rows))]

    def _head_root(self, rows: list[BatchRow], step: _DraftedStep) -> list[torch.Tensor]:
        """_draft_root for a draft head: its forward over every row's pending (target feature, token) pairs; each
        row's root state kept for its first level."""
        hidden, ids, pos, new_valid, block = root_block(
            self._d_fwd, [r.pending for r in rows], [r.length for r in rows], self.device
        )
        allowed = self.dcache.allowed(ids.shape[1])
        allowed[:, :, self.dcache.num_cols :] = block
        mask = additive_mask(allowed, self._d_dtype)
        h = self._d_fwd.step(hidden, ids, pos, self.dcache.cache, mask)[:, -1]
        self.dcache.append(new_valid)
        step.states, step.level_start = [h[b : b + 1] for b in range(len(rows))], [0] * len(rows)
        logits = self._d_fwd.target_logits(h)[:, : self.vocab_size]
        q_all = probs_by_settings(logits, step.q_settings)  # [B, V]
        return [q_all[b : b + 1] for b in range(len(rows))]

    def _draw_level(
        self, rows, step: _DraftedStep, shapes, lims, qs, growing: list[bool], depth: int
    ) -> list:
        """Every growing row's children at `depth` (a new tree level): the chain rows' draws at once (each row's
        uniform from its own generator), the greedy rows' top-n of q (one top_set per width; their walk needs no
        proposal), the other rows' proposals -> the (row, level) pairs the draft processes at this depth."""
        nb, trees = len(rows), step.trees
        draw = [b for b in range(nb) if step.chain[b] and growing[b] and depth <= lims[b]]
        drawn = {}
        if draw:
            tokens = sample_each(torch.cat([qs[b] for b in draw]), [rows[b].generator for b in draw]).tolist()
            drawn = dict(zip(draw, tokens, strict=True))
        tops: dict[int, list] = {}
        by_width: dict[int, list[int]] = {}
        for b in range(nb):
            if step.greedy[b] and growing[b] and depth <= lims[b]:
                by_width.setdefault(shapes[b][depth - 1], []).append(b)
        for n, group in by_width.items():
            ids = top_set(torch.cat([qs[b] for b in group]), n).tolist()
            at = 0
            for b in group:
                tops[b], at = ids[at : at + qs[b].shape[0]], at + qs[b].shape[0]
        feed = []
        for b, r in enumerate(rows):
            if not growing[b] or depth > lims[b]:
                growing[b] = False
                continue
            if b in drawn:
                level = trees[b].add_level([[drawn[b]]])
                step.chain_q[b].append(qs[b])
            elif b in tops:
                level = trees[b].add_level(tops[b])
            else:
                proposal = propose_at(
                    step.rules[b], qs[b], shapes[b][depth - 1], r.generator, r.length + depth
                )
                level = trees[b].add_level(proposal.token_ids.tolist())
                step.proposals[b].append(proposal)
            if len(level) == 0:
                growing[b] = False
                continue
            if depth < lims[b]:
                feed.append((b, level))
            else:
                growing[b] = False
        return feed

    def _feed_level(self, rows, step: _DraftedStep, qs, feed: list, depth: int) -> None:
        """ONE draft forward over the new levels of the rows in `feed` (each node sees its ancestors and itself),
        their columns recorded (node_col, not valid until accepted) -> each fed row's q at its level's nodes."""
        dev, nb = self.device, len(rows)
        width = max(len(level) for _, level in feed)
        t_old = self.dcache.num_cols
        ids_l, pos_l = [[0] * width for _ in rows], [[0] * width for _ in rows]
        allowed = self.dcache.allowed(width)
        allowed[:, :, t_old:] = torch.eye(width, dtype=torch.bool, device=dev)[None]  # a node sees itself
        for b, level in feed:
            tree, n = step.trees[b], len(level)
            ids_l[b][:n] = tree.tokens[level.start : level.stop]
            pos_l[b][:n] = [rows[b].length + depth] * n
            if level.start > 1:  # the level's ancestors among the earlier non-root nodes
                cols = [step.node_col[b][j] for j in range(1, level.start)]
                allowed[b, :n, cols] |= tree.mask(level, range(1, level.start)).to(dev)
        ids, pos = torch.tensor(ids_l, device=dev), torch.tensor(pos_l, device=dev)
        if self.head is not None:  # each node reads its parent's state, one position before the draft's
            hidden = torch.zeros(nb, width, self.head.config.hidden_size, dtype=self._d_dtype, device=dev)
            for b, level in feed:
                parents = [step.trees[b].parents[n] - step.level_start[b] for n in level]
                hidden[b, : len(level)] = step.states[b][parents]
            h = self._d_fwd.step(
                hidden, ids, pos - 1, self.dcache.cache, additive_mask(allowed, self._d_dtype)
            )
            for b, level in feed:
                step.states[b], step.level_start[b] = h[b, : len(level)], level.start
            logits = self._d_fwd.target_logits(h)
        else:
            logits = forward_logits(
                self._d_fwd, ids, self.dcache.cache, pos, additive_mask(allowed, self._d_dtype)
            )
        self.dcache.append(torch.zeros(nb, width, dtype=torch.bool, device=dev))
        fed_rows = [b for b, _ in feed]
        q_fed = probs_by_settings(
            logits[fed_rows, :, : self.vocab_size], [step.q_settings[b] for b in fed_rows]
        )
        for i, (b, level) in enumerate(feed):
            for j, node in enumerate(level):
                step.node_col[b][node] = t_old + j
            qs[b] = q_fed[i, : len(level)]
            step.fed[b] = depth

    # ------------------------------------------------------------------ verify and accept
    def _verify(self, rows: list[BatchRow], trees: list) -> torch.Tensor:
        """ONE target forward over every row's root and tree nodes -> logits [B, widest tree, V]. Ids and positions
        are built as lists and sent as one tensor each; a root alone needs no mask beyond the diagonal (per-row
        tensor ops cost ~10 us each, 16 rows x several per step)."""
        dev = self.device
        width = max(t.num_nodes for t in trees)
        tails = [[0] * (width - t.num_nodes) for t in trees]  # each row's padding after its nodes
        ids = torch.tensor([t.tokens + z for t, z in zip(trees, tails, strict=True)], device=dev)
        pos = torch.tensor(
            [[d + r.length for d in t.depths] + z for r, t, z in zip(rows, trees, tails, strict=True)],
            device=dev,
        )
        t_old = self.tcache.num_cols
        allowed = self.tcache.allowed(width)
        allowed[:, :, t_old:] = torch.eye(width, dtype=torch.bool, device=dev)[None]
        for b, tree in enumerate(trees):
            n = tree.num_nodes
            if n > 1:
                allowed[b, :n, t_old : t_old + n] = tree.mask(range(n), range(n)).to(dev)
        if self.head is not None:  # the head's features at every node come out of the same forward
            logits, self._feats = target_forward(
                self._target_fwd,
                self.head.layers,
                ids,
                self.tcache.cache,
                pos,
                additive_mask(allowed, self._t_dtype),
            )
            return logits
        return forward_logits(
            self._target_fwd, ids, self.tcache.cache, pos, additive_mask(allowed, self._t_dtype)
        )

    def _walk_chains(
        self, rows: list[BatchRow], step: _DraftedStep, logits: torch.Tensor
    ) -> dict[int, tuple[list[int], list[int]]]:
        """The chain rows' walks (row index -> (run, accepted)), grouped by chain depth, in batched ops
        (walk_one_draw_chains)."""
        walks: dict[int, tuple[list[int], list[int]]] = {}
        by_depth: dict[int, list[int]] = {}
        for b, tree in enumerate(step.trees):
            if step.chain[b]:
                by_depth.setdefault(tree.depth, []).append(b)
        for d, idx in by_depth.items():
            p = probs_by_settings(logits[idx, : d + 1, : self.vocab_size], [rows[b].settings for b in idx])
            drafted = torch.tensor(
                [step.trees[b].tokens[1 : d + 1] for b in idx], device=self.device
            )  # depth d
            q = torch.stack([torch.cat(step.chain_q[b]) for b in idx]) if d else None
            walked = walk_one_draw_chains(p, drafted, q, [rows[b].generator for b in idx])
            walks.update(zip(idx, walked, strict=True))
        return walks

    def _accept(
        self,
        rows: list[BatchRow],
        step: _DraftedStep,
        logits: torch.Tensor,
        walks: dict[int, tuple[list[int], list[int]]],
        flags: list,
        times: tuple[float, float, float],
    ) -> list[tuple[BatchRow, list[int]]]:
        """Every other row's walk (greedy: argmax p at every node, one host sync for the batch; sampled: the lean
        step's walk, the same randomness as the row decoded alone), then each row's tokens, stats and caches: the
        accepted nodes stay valid, both caches are compacted, finished rows leave."""
        t0, t1, t2 = times
        trees, fed, node_col = step.trees, step.fed, step.node_col
        best = logits[:, :, : self.vocab_size].argmax(-1).tolist() if any(step.greedy) else None
        t_valid = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=self.device)
        out = []
        for b, (r, tree) in enumerate(zip(rows, trees, strict=True)):
            if b in walks:
                run, accepted = walks[b]
            elif step.greedy[b]:
                run, accepted = walk_greedy(tree, best[b][: tree.num_nodes])
            else:

                def p_at(nodes: list[int], b: int = b, r: BatchRow = r) -> torch.Tensor:
                    return self._probs(logits[b, nodes], r.settings)

                run, accepted = walk_sampled(
                    step.rules[b], tree, p_at, step.proposals[b], r.generator, r.length + 1
                )
            t_valid[b, [0] + accepted] = True
            for n in accepted if self.head is None else ():  # a head's tree entries never persist
                if tree.depths[n] <= fed[b]:
                    self.dcache.valid[b, node_col[b][n]] = True
            r.length += len(accepted) + 1
            r.root = run[-1]
            s = r.stats
            s.target_forwards += 1
            s.target_seconds += t2 - t1
            if self.head is not None:  # the features of the root and the accepted nodes, with the emitted run
                feats = self._feats[b, [0] + accepted]
                r.pending = pending_after(r.pending, feats, run[: len(accepted) + 1], True)
            else:
                r.pending = [tree.tokens[n] for n in accepted if tree.depths[n] > fed[b]] + [run[-1]]
            if flags[b]:
                s.record_step(tree.num_nodes, len(accepted), tree.depth)
                s.draft_forwards += 1 + fed[b]
                s.draft_seconds += t1 - t0
            chunk = []
            for tok in run:
                chunk.append(tok)
                if r.emit(tok):
                    break
            out.append((r, chunk))
        self.tcache.append(t_valid)
        self.tcache.compact()
        self.dcache.compact()
        self._keep([r for r in rows if not r.finished])
        return out

    def _ar_step(self, rows: list[BatchRow], flags: list, t0: float) -> list[tuple[BatchRow, list[int]]]:
        """A step in which no row drafts: the autoregressive step on the holey cache (one query per row, its valid
        columns and itself; the token as the one-node walk would choose it, sampling.sample_at at the same
        position). The new column is valid in every row, so there is nothing to compact; the draft owes each row
        its new token (pending)."""
        dev, valid = self.device, self.tcache.valid
        ids = torch.tensor([[r.root] for r in rows], device=dev)
        pos = torch.tensor([[r.length] for r in rows], device=dev)
        new = valid.new_ones(len(rows), 1)
        allowed = torch.cat([valid, new], 1)[:, None]  # [B, 1, T + 1]
        mask = additive_mask(allowed, self._t_dtype)
        if self.head is not None:
            logits, feats = target_forward(
                self._target_fwd, self.head.layers, ids, self.tcache.cache, pos, mask
            )
            logits = logits[:, -1, : self.vocab_size]
        else:
            logits = forward_logits(self._target_fwd, ids, self.tcache.cache, pos, mask)[
                :, -1, : self.vocab_size
            ]
        self.tcache.append(new)
        out = self._emit_ar(rows, logits, t0)
        for b, (r, flag) in enumerate(zip(rows, flags, strict=True)):
            if self.head is not None:  # the pair (feature at the old root, the new token)
                r.pending = pending_after(r.pending, feats[b, :1], [r.root], False)
            else:
                r.pending.append(r.root)
            # asked to draft, but the emit budget left no room: an empty tree, as the batch-1 decoder records
            if flag:
                r.stats.record_step(1, 0, 0)
        self._keep([r for r in rows if not r.finished])
        return out
