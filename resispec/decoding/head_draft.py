"""The draft phase of a draft head (resispec/models/head.py) in the speculative step, batch 1.

The step (engine.py `SpeculativeDecoder._spec_steps`) is the same for both drafter kinds: draft a tree level by
level, verify it in ONE target forward, walk, compact. What differs for a head:
  - the target's forwards (prefill and verify) also return the states entering the head's layers (`target_forward`);
  - the head's pending input is pairs (target features at position j, token j+1), not tokens: after a step, the
    features of the root and the accepted nodes (from the verify forward) with the emitted run;
  - depth 0 is the head over the pending pairs (its cache then holds entries 0..L-2, L committed tokens); depth d
    feeds each node of level d its token and its PARENT's pre-norm output, at position L-2+d, under the tree mask;
  - after the walk the head's cache is cropped to its committed entries: tree entries were computed from the head's
    own states and never persist (EAGLE's rule); the next depth-0 forward appends the new pairs.
With a one-token prompt there is no target feature yet: the first step drafts nothing (an AR step).
"""

from __future__ import annotations

import torch

from resispec.decoding.batch_rows import left_padded
from resispec.decoding.fast_forward import FastCausalLM
from resispec.decoding.kv_cache import (
    cache_length,
    compact_to_path,
    crop_cache,
    new_cache,
    tree_attention_mask,
)
from resispec.decoding.tree import DraftTree


class HeadPending:
    """The (target features, next token) pairs the head has not read yet: feats [P, k*H], tokens [P]."""

    def __init__(self, feats: torch.Tensor, tokens: list[int]) -> None:
        self.feats, self.tokens = feats, tokens

    def __len__(self) -> int:
        return len(self.tokens)


def target_forward(fwd, layers, ids, cache, pos=None, mask=None, logits_to_keep: int = 0):
    """One cached target forward -> (logits [1, Q', V], the states entering `layers`, concatenated [1, Q, k*H]).
    The decoder's fast forward returns them directly; the HF forward through output_hidden_states (HF index k =
    the input of layer k for k < L)."""
    common = dict(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=logits_to_keep)
    if isinstance(fwd, FastCausalLM):
        out = fwd(cache=cache, use_cache=True, capture=tuple(layers), **common)
        return out.logits, out.hidden
    out = fwd(cache=cache, use_cache=True, output_hidden_states=True, **common)
    return out.logits, torch.cat([out.hidden_states[i] for i in layers], dim=-1)


def prefill_pending(prompt: list[int], feats: torch.Tensor | None, device) -> HeadPending:
    """The prompt's pairs: features of positions 0..L-2 (the target's prefill) with tokens 1..L-1."""
    if feats is None:
        return HeadPending(torch.zeros(0, 0, device=device), [])
    return HeadPending(feats[0], list(prompt[1:]))


class HeadLevels:
    """One step's draft phase for a head: `first()` -> depth-1 logits, then `deeper(tree, level, depth)` -> the
    logits of the next level's parents (module docstring). Logits over the target's vocabulary [n, V]."""

    def __init__(
        self, head, pending: HeadPending, cache, num_committed: int, vocab: int, forward_time
    ) -> None:
        self.head, self.pending, self.cache = head, pending, cache
        self.num_committed, self.vocab = num_committed, vocab
        self.timed = forward_time  # callable(fn) -> fn(), its time added to the step's draft forward seconds
        self.states: torch.Tensor | None = None  # [n_d, H] pre-norm outputs of the last level fed
        self.level_start = 0

    @property
    def ready(self) -> bool:
        """False with no target feature yet (a one-token prompt's first step): nothing to draft from."""
        return len(self.pending) > 0 or cache_length(self.cache) > 0

    def first(self) -> torch.Tensor:
        head, pend, dev = self.head, self.pending, self.head.device
        start = cache_length(self.cache)
        pos = torch.arange(start, start + len(pend), device=dev)[None]
        ids = torch.tensor([pend.tokens], device=dev)

        def run():
            return head.step(head.fuse(pend.feats[None]), ids, pos, self.cache)

        h = self.timed(run)[0, -1:]  # [1, H]: the root's entry (position L-2)
        self.states, self.level_start = h, 0
        return head.target_logits(h)[:, : self.vocab]

    def deeper(self, tree: DraftTree, level: range, depth: int) -> torch.Tensor:
        head, dev = self.head, self.head.device
        parents = torch.tensor([tree.parents[n] - self.level_start for n in level], device=dev)
        block = tree.mask(level, range(1, level.stop))
        mask = tree_attention_mask(self.num_committed - 1, block.to(dev), head.dtype)
        ids = torch.tensor([tree.tokens[level.start : level.stop]], device=dev)
        pos = torch.full((1, len(level)), self.num_committed - 2 + depth, device=dev)
        hidden = self.states.index_select(0, parents)[None]
        h = self.timed(lambda: head.step(hidden, ids, pos, self.cache, mask))[0]  # [n_d, H]
        self.states, self.level_start = h, level.start
        return head.target_logits(h)[:, : self.vocab]


def advance_head(
    tcache, hcache, num_committed: int, accepted: list[int], drafted: bool, pending: HeadPending, run, feats
) -> HeadPending:
    """After a step: the target's cache compacted to the accepted path, the head's cropped to its committed entries;
    returns the pairs the head reads next: the features of the root and the accepted nodes (feats [N+1, k*H] of
    the verify forward) with the emitted run."""
    keep = [0] + accepted
    compact_to_path(tcache, num_committed - 1, keep)
    new = feats.index_select(0, torch.tensor(keep, device=feats.device))
    if drafted:
        crop_cache(hcache, num_committed - 1)
        return HeadPending(new, list(run))
    old = pending.feats if len(pending) else new[:0]
    return HeadPending(torch.cat([old, new]), pending.tokens + list(run))


# ---------------------------------------------------------------------------- batched (resispec/decoding/batch_spec.py)
# The batched step runs a head as the batch-1 step does, per row: the head's batch cache holds each row's committed
# entries (valid columns) and this step's tree entries (appended, never made valid: dropped by the holey cache's
# compaction); each row's pending pairs are a HeadPending in its `pending`; the root forward takes every row's pairs
# LEFT-padded (rows' last pair in the last column), the levels their parents' states.


def join_pending(target_fwd, target, layers, prompt: list[int], device) -> HeadPending:
    """A joining row's pairs: its prompt's target features from the batch-1 prefill forward (the computation the
    batch-1 decoder makes, so the row's head input does not depend on its neighbours)."""
    if len(prompt) < 2:
        return HeadPending(torch.zeros(0, 0, device=device), [])
    ids = torch.tensor([prompt[:-1]], device=device)
    feats = target_forward(target_fwd, layers, ids, new_cache(target), logits_to_keep=1)[1]
    return HeadPending(feats[0], list(prompt[1:]))


def pending_after(
    pending: HeadPending, feats: torch.Tensor, tokens: list[int], consumed: bool
) -> HeadPending:
    """The pairs a row owes the head after a step: the new (feature, token) pairs, after the old ones unless the
    head read those this step."""
    if consumed or len(pending) == 0:
        return HeadPending(feats, list(tokens))
    return HeadPending(torch.cat([pending.feats, feats]), pending.tokens + list(tokens))


def root_block(head, pendings: list[HeadPending], lengths: list[int], device):
    """The root forward's inputs for every row, LEFT-padded: (fused hidden [B, W, H], ids [B, W], positions [B, W],
    valid [B, W], allowed [B, W, W]); `lengths`: each row's root position (its pairs end at position length - 1)."""
    seqs = [p.tokens for p in pendings]
    ids, pos, valid, allowed = left_padded(
        seqs, [n - len(s) for n, s in zip(lengths, seqs, strict=True)], device
    )
    width = ids.shape[1]
    feats = torch.zeros(len(pendings), width, head.fc.in_features, dtype=head.dtype, device=device)
    for b, p in enumerate(pendings):
        if len(p):
            feats[b, width - len(p) :] = p.feats.to(head.dtype)
    return head.fuse(feats), ids, pos, valid, allowed
