"""The exact speculative tree decoder (batch 1): draft a tree, verify it in one target forward, accept with a rule.

One step (`SpeculativeDecoder._spec_steps`), with L committed tokens (the last one, the root, is not yet in the
target cache):
  draft:  one draft forward per depth d = 0..D-1 (depth 0 = the pending committed tokens, deeper ones = the whole
          tree level at once under a tree mask); the rule proposes each node's draws from q; repeated draws merge.
  verify: ONE target forward over [root, all tree nodes] with the tree mask; position = L - 1 + depth.
  accept: walk from the root, the rule verifying only the nodes the walk reaches (a run of single-child nodes in
          one call; resispec/decoding/walk.py); emit the accepted path plus one correction/bonus token.
  cache:  both caches are compacted to the accepted path (gather + truncate, never re-encoding); when the whole
          path is accepted, the deepest token (never fed to the draft) is fed with the next step's depth-0 forward.
The readable reference step (whole levels verified, every node's p built) is the exactness oracle of the tests:
tests/oracle_decoder.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from resispec.decoding.fast_forward import fast_forward as make_forward
from resispec.decoding.head_draft import HeadLevels, advance_head, prefill_pending, target_forward
from resispec.decoding.kv_cache import (
    cache_length,
    forward_logits,
    new_cache,
    tree_attention_mask,
)
from resispec.decoding.stats import DecodeStats
from resispec.decoding.stopping import StopChecker, model_eos, normalize_eos, stop_checkers
from resispec.decoding.tree import DraftTree, max_tree_nodes, parse_tree
from resispec.decoding.vocab import check_tokenizers, resolve_vocab_size
from resispec.decoding.walk import (
    advance_caches,
    propose_at,
    resolve_rule,
    row_rule,
    walk_greedy,
    walk_sampled,
)
from resispec.models.head import is_head
from resispec.sampling import is_greedy, probs, sample_at


@dataclass
class DecodeOutput:
    sequences: torch.Tensor  # [1, L] prompt + generated
    stats: DecodeStats


class SpeculativeDecoder:
    """Exact speculative decoding of `target` with `draft` (HF causal LMs sharing a tokenizer, or a draft head:
    resispec/models/head.py, its draft phase resispec/decoding/head_draft.py), batch 1.

    rule: a name in `resispec.verify.VERIFIERS` (or a rule object); tree: branching per depth ([1]*k = chain).
    tokenizer: optional, needed only for `stop` strings. tokenizer_target / tokenizer_draft: when both are given
    they are checked to be the same tokenizer (TokenizerMismatchError otherwise).
    compile: torch.compile the two HF model forwards (CUDA only; it replaces the fast forward).
    fast_forward: run Llama-family models through the decoder's own forward (resispec/decoding/fast_forward.py:
        the model's weights, fewer ops, K/V appended in place); False, or an unsupported architecture, runs the HF
        forward.
    timing: synchronise CUDA around phases so draft/target seconds are exact (costs a little on GPU).
    greedy_topk: at temperature 0, draft the top-b tokens per node and verify by argmax matching (every exact
        rule reduces to that at temperature 0; see resispec/verify/greedy.py). False runs the rule itself on one-hot
        p and q (for i.i.d. rules the tree then collapses to a chain).
    """

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        rule="resispec",
        tree: Sequence[int] = (4, 2, 1, 1),
        tokenizer=None,
        tokenizer_target=None,
        tokenizer_draft=None,
        compile: bool = False,
        timing: bool = True,
        greedy_topk: bool = True,
        fast_forward: bool = True,
    ) -> None:
        check_tokenizers(tokenizer_target, tokenizer_draft)
        self.target, self.draft = target.eval(), draft.eval()
        self.head = draft if is_head(draft) else None  # a draft head reads the target's states
        self.tokenizer = tokenizer if tokenizer is not None else tokenizer_target
        self.vocab_size = resolve_vocab_size(target, target if self.head else draft, self.tokenizer)
        self.rule_name = rule if isinstance(rule, str) else type(rule).__name__
        self.rule = resolve_rule(rule)
        self.shape = parse_tree(list(tree))
        self.max_nodes = max_tree_nodes(self.shape)
        self.device = next(target.parameters()).device
        if next(draft.parameters()).device != self.device:
            raise ValueError("target and draft must be on the same device")
        for name, model in (("target", target), ("draft", draft)):
            impl = getattr(model.config, "_attn_implementation", "sdpa")
            if impl not in ("sdpa", "eager"):
                raise ValueError(
                    f"the {name} uses attn_implementation={impl!r}; the tree mask needs 'sdpa' or 'eager' "
                    "(load with attn_implementation='sdpa')"
                )
        self.timing = timing
        self.greedy_topk = greedy_topk
        self._t_dtype, self._d_dtype = target.dtype, draft.dtype  # read once: .dtype walks the parameters
        self._target_fwd: Callable = make_forward(target) if fast_forward else target
        self._draft_fwd: Callable = make_forward(draft) if fast_forward else draft  # a head's: FastHead
        if compile and self.device.type == "cuda":
            self._target_fwd = torch.compile(target, dynamic=True)
            if not self.head:
                self._draft_fwd = torch.compile(draft, dynamic=True)
        self.last_stats: DecodeStats | None = None
        # test hook: called after each step's cache compaction with (target_cache, draft_cache, committed_ids)
        self.after_step: Callable | None = None

    @property
    def target_forward(self) -> Callable:
        """The target's forward the decoder runs (the fast forward, the HF model or its compiled forward)."""
        return self._target_fwd

    @property
    def draft_forward(self) -> Callable:
        """The draft's forward the decoder runs."""
        return self._draft_fwd

    # ------------------------------------------------------------------ public API
    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, **kwargs) -> DecodeOutput:
        """Speculative decoding. kwargs as `generate_stream`. Returns prompt + generated and the stats."""
        return self._collect(input_ids, self.generate_stream(input_ids, **kwargs))

    @torch.inference_mode()
    def generate_autoregressive(self, input_ids: torch.Tensor, **kwargs) -> DecodeOutput:
        """Plain target decoding (the baseline): same interface, same cache path and sampling transform."""
        return self._collect(input_ids, self.generate_stream(input_ids, speculative=False, **kwargs))

    def generate_stream(
        self,
        input_ids: torch.Tensor,  # [1, L] (or [L])
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_token_id: int | Sequence[int] | None = None,
        stop: str | Sequence[str] | None = None,
        stop_checker: StopChecker | None = None,
        generator: torch.Generator | None = None,
        speculative: bool = True,
    ) -> Iterator[list[int]]:
        """Yield each step's newly emitted token ids (batch 1). Stats land in `self.last_stats` at the end.

        eos_token_id None -> the target's generation_config.eos_token_id; pass [] to disable EOS stopping.
        stop: string(s) ending generation (needs `tokenizer`); stop_checker: any callable(generated_ids) -> bool.
        The token that triggers a stop is emitted; nothing after it is.
        """
        prompt = self._prompt_list(input_ids)
        if eos_token_id is None:
            eos_token_id = model_eos(self.target)
        checkers = stop_checkers(self.tokenizer, stop, stop_checker, type(self).__name__)
        settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        steps = self._spec_steps if speculative else self._ar_steps
        stats = DecodeStats(
            accepted_per_position=[0] * len(self.shape), reached_per_position=[0] * len(self.shape)
        )
        self.last_stats = stats
        return self._emit(
            steps(prompt, settings, generator, stats, max_new_tokens),
            max_new_tokens,
            normalize_eos(eos_token_id),
            checkers,
            stats,
        )

    # ------------------------------------------------------------------ shared plumbing
    def _prompt_list(self, input_ids) -> list[int]:
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise NotImplementedError(
                    "SpeculativeDecoder supports batch size 1 only; loop over the batch"
                )
            ids = ids[0]
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        return ids.tolist()

    def _collect(self, input_ids, stream: Iterator[list[int]]) -> DecodeOutput:
        prompt = torch.as_tensor(input_ids).reshape(1, -1)
        new = [tok for chunk in stream for tok in chunk]
        gen = torch.tensor([new], dtype=prompt.dtype, device=prompt.device)
        return DecodeOutput(sequences=torch.cat([prompt, gen], dim=1), stats=self.last_stats)

    def _emit(self, steps, max_new_tokens, eos, checkers, stats) -> Iterator[list[int]]:
        """Cut each step's run at the first stop condition; close the step generator after a stop."""
        start = time.perf_counter()
        generated: list[int] = []
        try:
            if max_new_tokens <= 0:
                return
            for run in steps:
                chunk, done = [], False
                for tok in run:
                    generated.append(tok)
                    chunk.append(tok)
                    if tok in eos or len(generated) >= max_new_tokens or any(c(generated) for c in checkers):
                        done = True
                        break
                stats.num_new_tokens += len(chunk)
                stats.total_seconds = time.perf_counter() - start
                yield chunk
                if done:
                    return
        finally:
            steps.close()
            stats.total_seconds = time.perf_counter() - start

    def _draft_forward(self, stats: DecodeStats, ids, cache, pos, mask=None, logits_to_keep: int = 0):
        """One cached draft forward, its wall time added to stats.draft_forward_seconds (not synchronised: on
        CUDA that is launch time; the draft phase as a whole is synchronised)."""
        t0 = time.perf_counter()
        logits = forward_logits(self._draft_fwd, ids, cache, pos, mask, logits_to_keep=logits_to_keep)
        stats.draft_forward_seconds += time.perf_counter() - t0
        return logits

    def _timed_draft(self, stats: DecodeStats, fn: Callable):
        """fn() with its wall time added to stats.draft_forward_seconds (as `_draft_forward`)."""
        t0 = time.perf_counter()
        out = fn()
        stats.draft_forward_seconds += time.perf_counter() - t0
        return out

    def _sync(self) -> None:
        if self.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _probs(self, logits: torch.Tensor, settings: dict) -> torch.Tensor:
        """[N, V'] logits -> [N, V] probabilities (vocab cut to the shared size, then THE sampling transform)."""
        return probs(logits[..., : self.vocab_size], **settings)

    def _prefill_target(self, prompt: list[int], stats: DecodeStats, capture: bool = False):
        """Target cache := prompt[:-1]; the last prompt token is the first root. capture (a draft head): returns
        (cache, the head's pending pairs of the prompt)."""
        cache, feats = new_cache(self.target), None
        if len(prompt) > 1:
            self._sync()
            t0 = time.perf_counter()
            ids = torch.tensor([prompt[:-1]], device=self.device)
            if capture:
                feats = target_forward(self._target_fwd, self.head.layers, ids, cache, logits_to_keep=1)[1]
            else:
                forward_logits(self._target_fwd, ids, cache, logits_to_keep=1)
            self._sync()
            stats.target_seconds += time.perf_counter() - t0
            stats.target_forwards += 1
        return (cache, prefill_pending(prompt, feats, self.device)) if capture else cache

    # ------------------------------------------------------------------ autoregressive baseline
    @torch.inference_mode()  # torch wraps each resume of a generator, so the consumer is unaffected
    def _ar_steps(self, prompt, settings, generator, stats, max_new_tokens) -> Iterator[list[int]]:
        cache = self._prefill_target(prompt, stats)
        pos, root = len(prompt) - 1, prompt[-1]
        greedy = is_greedy(settings["temperature"])
        while True:
            self._sync()
            t0 = time.perf_counter()
            ids = torch.tensor([[root]], device=self.device)
            logits = forward_logits(self._target_fwd, ids, cache, torch.tensor([[pos]], device=self.device))
            logits = logits[0, -1:, : self.vocab_size]  # [1, V]
            if greedy:
                tok = logits.argmax(dim=-1)
            else:
                tok = sample_at(probs(logits, **settings), generator, pos + 1)
            root = int(tok.item())
            stats.target_seconds += time.perf_counter() - t0
            stats.target_forwards += 1
            pos += 1
            yield [root]

    # ------------------------------------------------------------------ the speculative step
    @torch.inference_mode()
    def _spec_steps(self, prompt, settings, generator, stats, max_new_tokens) -> Iterator[list[int]]:
        """The speculative step (module docstring), step after step: yields each step's emitted run."""
        rule = row_rule(self.rule, generator)
        greedy = is_greedy(settings["temperature"]) and self.greedy_topk
        dcache = new_cache(self.draft)
        num_committed = len(prompt)  # L; the root prompt[-1] is the last committed token
        if self.head is None:
            tcache = self._prefill_target(prompt, stats)
            # committed tokens not yet in the draft cache (the draft prefill is folded in)
            pending = list(prompt)
        else:  # the head's pending input: (target features at j, token j + 1) pairs
            tcache, pending = self._prefill_target(prompt, stats, capture=True)
        root = prompt[-1]
        committed = list(prompt)  # only kept up to date for the after_step hook
        remaining = max_new_tokens
        while True:
            # ---- draft phase: one forward per depth
            self._sync()
            t0 = time.perf_counter()
            # never draft deeper than can be emitted: with r tokens left, r - 1 drafts plus the bonus token
            depth_lim = min(len(self.shape), remaining - 1)
            tree, proposals, fed_depth = self._draft_tree(
                root, pending, dcache, num_committed, depth_lim, rule, settings, generator, greedy, stats
            )
            self._sync()
            t1 = time.perf_counter()
            stats.draft_seconds += t1 - t0
            stats.draft_forwards += 1 + fed_depth if depth_lim > 0 else 0

            # ---- verify phase: ONE target forward over the root and every node
            logits, feats = self._verify_tree(tree, tcache, num_committed)  # [N+1, V], a head's [N+1, k*H]
            if greedy:
                best = logits.argmax(dim=-1).tolist()  # the one host sync of a greedy step
            self._sync()
            t2 = time.perf_counter()
            stats.target_seconds += t2 - t1
            stats.target_forwards += 1

            # ---- accept phase: the walk from the root (resispec/decoding/walk.py)
            if greedy:
                run, accepted = walk_greedy(tree, best)
            else:

                def p_at(nodes: list[int], logits: torch.Tensor = logits) -> torch.Tensor:
                    return self._probs(logits[nodes], settings)  # [len(nodes), V]

                run, accepted = walk_sampled(rule, tree, p_at, proposals, generator, num_committed)
            stats.accept_seconds += time.perf_counter() - t2
            stats.record_step(tree.num_nodes, len(accepted), tree.depth)
            yield run  # the consumer closes this generator at a stop, so no cache work is wasted after it

            # ---- compact both caches to the accepted path
            if self.head is None:
                pending = advance_caches(
                    tcache, dcache, num_committed, tree, accepted, fed_depth, depth_lim > 0, pending, run
                )
            else:  # fed_depth < 0: the head drafted nothing (no target feature yet)
                drafted = depth_lim > 0 and fed_depth >= 0
                pending = advance_head(tcache, dcache, num_committed, accepted, drafted, pending, run, feats)
            remaining -= len(run)
            num_committed += len(accepted) + 1
            root = run[-1]
            if self.after_step is not None:
                committed.extend(run)
                self.after_step(tcache, dcache, committed)

    def _draft_tree(
        self, root, pending, dcache, num_committed, depth_lim, rule, settings, generator, greedy, stats
    ) -> tuple[DraftTree, list, int]:
        """The draft phase: the draft's forward over the `pending` committed tokens, then one forward per tree level
        (under the tree mask), each node's children drawn from q by the rule (greedy: the top-b of the draft's
        logits) -> (tree, the rule's proposal per depth, the deepest level the draft's cache now holds)."""
        dev, vocab = self.device, self.vocab_size
        tree = DraftTree(root, self.max_nodes)
        proposals: list = []
        fed_depth = 0  # deepest level the draft has processed (its cache holds levels 1..fed_depth)
        if depth_lim <= 0:
            return tree, proposals, fed_depth
        if self.head is not None:
            levels = HeadLevels(
                self._draft_fwd,
                pending,
                dcache,
                num_committed,
                vocab,
                lambda fn: self._timed_draft(stats, fn),
            )
            if not levels.ready:
                return tree, proposals, -1
            logits = levels.first()  # [1, V]
        else:
            start = cache_length(dcache)
            pos = torch.arange(start, start + len(pending), device=dev)[None]  # [1, P]
            ids = torch.tensor([pending], device=dev)
            logits = self._draft_forward(stats, ids, dcache, pos, logits_to_keep=1)[0, :, :vocab]  # [1, V]
        for depth in range(1, depth_lim + 1):
            width = self.shape[depth - 1]
            if greedy:  # top-b of the draft's logits = top-b of its softmax
                draws = torch.topk(logits, min(width, vocab), dim=-1).indices.tolist()
            else:
                q = self._probs(logits, settings)
                proposal = propose_at(rule, q, width, generator, num_committed - 1 + depth)
                proposals.append(proposal)
                draws = proposal.token_ids.tolist()  # one host sync per depth
            level = tree.add_level(draws)
            if len(level) == 0:
                if proposals:
                    proposals.pop()
                break
            if depth == depth_lim:
                break
            if self.head is not None:
                logits = levels.deeper(tree, level, depth)  # [n_d, V]
                fed_depth = depth
                continue
            block = tree.mask(level, range(1, level.stop))  # [n_d, nodes so far]
            mask = tree_attention_mask(num_committed, block.to(dev), self._d_dtype)
            ids = torch.tensor([tree.tokens[level.start : level.stop]], device=dev)
            pos = torch.full((1, len(level)), num_committed - 1 + depth, device=dev)
            logits = self._draft_forward(stats, ids, dcache, pos, mask)[0, :, :vocab]  # [n_d, V]
            fed_depth = depth
        return tree, proposals, fed_depth

    def _verify_tree(
        self, tree: DraftTree, tcache, num_committed: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ONE target forward over the root and every node of `tree` (tree mask; position = L - 1 + depth) ->
        (logits [N+1, V] (the vocabulary cut to the pair's), for a draft head the states entering its layers at
        every node [N+1, k*H], else None)."""
        dev = self.device
        nodes = range(0, tree.num_nodes)
        mask = tree_attention_mask(num_committed - 1, tree.mask(nodes, nodes).to(dev), self._t_dtype)
        ids = torch.tensor([tree.tokens], device=dev)
        pos = torch.tensor([tree.depths], device=dev) + (num_committed - 1)
        if self.head is not None:
            logits, feats = target_forward(self._target_fwd, self.head.layers, ids, tcache, pos, mask)
            return logits[0, :, : self.vocab_size], feats[0]
        return forward_logits(self._target_fwd, ids, tcache, pos, mask)[0, :, : self.vocab_size], None
