"""The ONE sampling transform: temperature, top-k and top-p applied identically to p (target) and q (draft)."""

from __future__ import annotations

import torch

# Below this temperature the transform is greedy, as in vLLM (its _SAMPLING_EPS): 1/T would overflow the logits to
# inf and the probabilities to NaN (a sampled id equal to the vocabulary size).
GREEDY_BELOW_TEMPERATURE = 1e-5


def process_logits(
    logits: torch.Tensor,  # [N, V]
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Logits -> probabilities [N, V] (float32) under the sampling settings.

    Temperature 0 means greedy: the result is one-hot at the argmax (first index on ties, as HF greedy does), so
    every verification rule degenerates to exact greedy matching. So is any temperature below
    GREEDY_BELOW_TEMPERATURE.
    """
    if temperature < GREEDY_BELOW_TEMPERATURE:
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token always stays)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop[..., 0] = False  # also when top_p is below float32's resolution
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)


def sample_tokens(
    probs: torch.Tensor,  # [N, V]
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row [N] from `probs`."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
