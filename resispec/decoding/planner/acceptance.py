"""The acceptance model: per-node acceptance alpha(n) by number of draws, calibrated on the target's own
continuations (calibrate_alpha), and the product model's tau (expected_tau). See the package docstring."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from resispec.decoding.batch_ar import BatchedDecoder
from resispec.sampling import is_greedy, probs
from resispec.verify import VERIFIERS
from resispec.verify.estimate import mean_acceptance

MAX_DRAWS = 4  # alpha(n) is calibrated for n = 1 .. MAX_DRAWS: the widest level a candidate tree may have


@torch.inference_mode()
def node_logits(
    target: torch.nn.Module, draft: torch.nn.Module, sequences: Sequence[Sequence[int]], start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits [N, V] (the pair's shared vocabulary, float32) at the positions >= `start` of each
    sequence: the nodes a calibration scores."""
    dev = next(target.parameters()).device
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    ps, qs = [], []
    for seq in sequences:
        ids = torch.tensor([list(seq)], device=dev)
        ps.append(target(input_ids=ids).logits[0, start - 1 : -1, :vocab].float())
        qs.append(draft(input_ids=ids).logits[0, start - 1 : -1, :vocab].float())
    return torch.cat(ps), torch.cat(qs)


@torch.inference_mode()
def calibrate_alpha(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    rule,
    settings: dict,
    start: int,
    max_draws: int = MAX_DRAWS,
    samples: int = 64,
    seed: int = 0,
    logits: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[int, float]:
    """Mean per-node acceptance alpha(n), n = 1..max_draws, of `rule` (a VERIFIERS key, or the rule object the
    decoder will run: resispec_auto with a policy) under `settings` (temperature/top-k/top-p)
    at the positions >= `start` of each sequence (prompt + the target's own continuation). Temperature 0: the
    greedy rule's acceptance, P(argmax p among the top-n of q). `logits`: those nodes' (target, draft) logits when
    the caller already has them (node_logits of the same sequences and start)."""
    t_logits, d_logits = logits if logits is not None else node_logits(target, draft, sequences, start)
    if is_greedy(settings.get("temperature", 1.0)):
        alpha = greedy_alpha([greedy_hits(t_logits, d_logits, max_draws)])
        return {n: alpha[min(n, len(alpha))] for n in range(1, max_draws + 1)}
    p, q = probs(t_logits, **settings), probs(d_logits, **settings)
    rule_obj = VERIFIERS[rule] if isinstance(rule, str) else rule
    gen = torch.Generator(device=p.device).manual_seed(seed)
    return {n: mean_acceptance(rule_obj, p, q, n, samples, gen) for n in range(1, max_draws + 1)}


def expected_tau(tree: Sequence[int], alpha: dict[int, float]) -> float:
    """1 + sum_d prod_{j <= d} alpha(b_j): the accepted length if depths accept independently."""
    tau, reach = 1.0, 1.0
    for b in tree:
        reach *= alpha[b]
        tau += reach
    return tau


def greedy_hits(t_logits: torch.Tensor, d_logits: torch.Tensor, max_draws: int) -> torch.Tensor:
    """[max_draws, N] bool: at each node, the target's argmax among the draft's top n, row n - 1 (n = 1..max_draws).
    Its row means are greedy alpha(n)."""
    top = d_logits.topk(min(max_draws, d_logits.shape[-1]), dim=-1).indices  # [N, n]
    return hits_of(t_logits.argmax(-1), top)


def hits_of(best: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """greedy_hits from indices: the target's argmax `best` [N] and the draft's top ids `top` [N, n] -> [n, N]."""
    return (top == best[:, None]).cumsum(-1).bool().T


@torch.inference_mode()
def teacher_forced_logits(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    starts: Sequence[int],
    vocab: int,
    rows: int = 8,
    keep=lambda logits: logits,
) -> list[torch.Tensor]:
    """Each sequence's float32 logits [len - start, vocab] of `model` (its first `vocab`) at the positions that
    predict its tokens start .. len - 1, passed through `keep` (e.g. a top-k), from teacher-forced forwards of
    `rows` sequences at a time, right-padded: under causal attention the padding after a position never reaches it.
    Only the positions from the chunk's earliest start on get logits (logits_to_keep: a long prompt under a 128k
    vocabulary does not materialise a logit row per prompt token)."""
    device = next(model.parameters()).device
    out = []
    for lo in range(0, len(sequences), rows):
        chunk, at_starts = [list(s) for s in sequences[lo : lo + rows]], starts[lo : lo + rows]
        width = max(len(s) for s in chunk)
        first = min(at_starts) - 1  # the first position kept
        ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s in chunk], device=device)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=width - first).logits[..., :vocab]
        for row, (seq, start) in enumerate(zip(chunk, at_starts, strict=True)):
            out.append(keep(logits[row, start - 1 - first : len(seq) - 1 - first].float()))
    return out


def teacher_forced_top(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    starts: Sequence[int],
    k: int,
    vocab: int,
    rows: int = 8,
) -> list[torch.Tensor]:
    """Each sequence's top-k ids [len - start, k] of `model`'s logits at the positions that predict its tokens
    start .. len - 1 (teacher_forced_logits)."""
    return teacher_forced_logits(
        model, sequences, starts, vocab, rows, keep=lambda lg: lg.topk(k, dim=-1).indices
    )


def sampled_alpha(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    starts: Sequence[int],
    rule,
    settings: dict,
    samples: int = 64,
    rows: int = 8,
) -> tuple[dict[int, float], tuple[torch.Tensor, torch.Tensor]]:
    """calibrate_alpha over many continuations (`sequences`, each scored from its `starts`), `rows` at a time
    (batched teacher-forced forwards: teacher_forced_logits), every node weighing alike; and the first sequence's
    (target, draft) node logits. With continuations of one length this is the mean of their per-continuation
    alphas, as calibrate_alpha one at a time gives; `samples`: Monte Carlo runs a node where a rule has no closed
    form."""
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    sums: dict[int, float] = {}
    nodes, first = 0, None
    for lo in range(0, len(sequences), rows):
        seqs, at = sequences[lo : lo + rows], starts[lo : lo + rows]
        t_logits, d_logits = (teacher_forced_logits(m, seqs, at, vocab, rows) for m in (target, draft))
        first = first or (t_logits[0], d_logits[0])
        logits = torch.cat(t_logits), torch.cat(d_logits)
        chunk = calibrate_alpha(
            target, draft, seqs, rule, settings, 0, samples=samples, seed=lo, logits=logits
        )
        n = logits[0].shape[0]
        sums = {k: sums.get(k, 0.0) + v * n for k, v in chunk.items()}
        nodes += n
    return {k: v / nodes for k, v in sums.items()}, first


@torch.inference_mode()
def greedy_continuations(
    target: torch.nn.Module, prompts: Sequence[Sequence[int]], tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt with the target's greedy continuation of `tokens` tokens, EOS ignored (what a decode of it at
    temperature 0 emits, each token the target's argmax there: what the decoder verifies against), and those
    tokens as tensors ([tokens] each). Decoded together by the batched AR decoder, whose greedy tokens are batch
    1's (tested; a near-tie that a batch broke otherwise would only move the continuation greedy_tau counts on,
    not make its count wrong)."""
    rows = BatchedDecoder(target).generate(
        [list(p) for p in prompts], dict(max_new_tokens=tokens, temperature=0.0, eos_token_id=[])
    )
    device = next(target.parameters()).device
    seqs = [list(p) + g for p, g in zip(prompts, rows, strict=True)]
    return seqs, [torch.tensor(g, device=device) for g in rows]


@torch.inference_mode()
def sampled_continuations(
    target: torch.nn.Module, prompts: Sequence[Sequence[int]], tokens: int, settings: dict, seed: int
) -> list[list[int]]:
    """Each prompt with a continuation of `tokens` tokens sampled from the target under `settings` (temperature,
    top_k, top_p), EOS ignored, row i seeded `seed` + i: all decoded together by the batched AR decoder (the
    sequences calibrate_alpha scores: the planner's calibration and the bench's check of its plans)."""
    device = next(target.parameters()).device
    rows = BatchedDecoder(target).generate(
        [list(p) for p in prompts],
        [
            dict(
                settings,
                max_new_tokens=tokens,
                eos_token_id=[],
                generator=torch.Generator(device=device).manual_seed(seed + i),
            )
            for i in range(len(prompts))
        ],
    )
    return [list(p) + g for p, g in zip(prompts, rows, strict=True)]


def greedy_hit_sets(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    continuations: tuple[list[list[int]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """Each prompt's greedy_hits [MAX_DRAWS, len] along its greedy continuation (greedy_continuations' output),
    from which greedy_tau counts any tree's tau as the decoder would: the target's greedy tokens against the
    draft's top MAX_DRAWS, one batched teacher-forced draft forward per 8 prompts."""
    seqs, best = continuations
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    top = teacher_forced_top(draft, seqs, [len(p) for p in prompts], MAX_DRAWS, vocab)
    return [hits_of(b, t) for b, t in zip(best, top, strict=True)]


def greedy_alpha(hit_sets: Sequence[torch.Tensor]) -> dict[int, float]:
    """Greedy alpha(n) from each continuation's greedy_hits: the hit rate of each, averaged over them (as
    calibrate_alpha's, per continuation)."""
    rows = hit_sets[0].shape[0]
    return {
        n: sum(float(h[n - 1].double().mean()) for h in hit_sets) / len(hit_sets) for n in range(1, rows + 1)
    }


def greedy_walk(tree: Sequence[int], hits: torch.Tensor) -> tuple[int, int]:
    """(speculative steps, draft tokens accepted) of the decoder at temperature 0 emitting the continuation whose
    greedy_hits are `hits` ([max_draws, N]: node i predicts continuation token i from the tokens before it) with
    `tree` [b_1, ..., b_D]. A step from token k accepts level j while token k + j - 1 is among the draft's top b_j
    there, drafts at most r - 1 levels with r tokens left (the decoder's depth limit), and emits the accepted run
    and one token more. At temperature 0 the decoder emits the target's greedy continuation and drafts each
    node's top-b draft logits, so its accepted path runs along that continuation: this is the decoder's own
    count, up to argmax ties that a teacher-forced forward and a cached one break differently (tested equal)."""
    rows = [hits[b - 1].tolist() for b in tree]
    total = hits.shape[-1]
    k = steps = accepted = 0
    while k < total:
        limit = min(len(tree), total - k - 1)
        a = 0
        while a < limit and rows[a][k + a]:
            a += 1
        steps, accepted, k = steps + 1, accepted + a, k + a + 1
    return steps, accepted


def greedy_tau(tree: Sequence[int], hit_sets: Sequence[torch.Tensor]) -> float:
    """The decoder's tau at temperature 0 with `tree` over every continuation of `hit_sets` (greedy_walk each):
    accepted draft tokens plus steps, over steps (DecodeStats.tau)."""
    counts = [greedy_walk(tree, hits) for hits in hit_sets]
    steps = sum(s for s, _ in counts)
    return (sum(a for _, a in counts) + steps) / steps if steps else 1.0
