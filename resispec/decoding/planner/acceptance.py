"""The acceptance model: per-node acceptance alpha(n) by number of draws, calibrated on the target's own
continuations (calibrate_alpha), and the product model's tau (expected_tau). See the package docstring."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from resispec.sampling import is_greedy, probs
from resispec.verify import VERIFIERS
from resispec.verify.estimate import mean_acceptance


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
    max_draws: int = 4,
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
        hits = greedy_hits(t_logits, d_logits, max_draws).double().mean(-1)
        return {n: float(hits[min(n, len(hits)) - 1]) for n in range(1, max_draws + 1)}
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
    best = t_logits.argmax(-1, keepdim=True)  # [N, 1]
    top = d_logits.topk(min(max_draws, d_logits.shape[-1]), dim=-1).indices  # [N, n]
    return (top == best).cumsum(-1).bool().T
