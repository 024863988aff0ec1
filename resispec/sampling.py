"""THE sampling transform: temperature, top-k and top-p, applied identically to p (target) and q (draft).

The decoder, the losses and the held-out evaluation that chooses checkpoints all call this module, so the
distribution trained on is the one served (docs/design.md: p and q "after the SAME temperature / top-k / top-p
processing"). One filter, two views:

- `probs(logits, temperature, top_k, top_p)`: probabilities for the decoder. Temperature 0 means greedy: one-hot
  at the argmax (first index on ties, as HF greedy does), so every verification rule degenerates to exact greedy
  matching.
- `log_probs(logits, temperature, top_k, top_p)`: log-probabilities for losses and evaluation. Temperature 0 is
  taken as 1 (`effective_temperature`): a greedy target has no distribution to match, and a temperature-1 match
  is what makes the argmaxes agree.

For temperature > 0, `probs(...) == log_probs(...).exp()` (tests/unit/test_sampling.py holds them to it).
This module imports nothing from resispec (tests/unit/test_layers.py).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# Below this temperature the transform is greedy, as in vLLM (its _SAMPLING_EPS): 1/T would overflow the logits to
# inf and the probabilities to NaN (a sampled id equal to the vocabulary size).
GREEDY_BELOW_TEMPERATURE = 1e-5


def is_greedy(temperature: float) -> bool:
    """Temperature 0, or any temperature below GREEDY_BELOW_TEMPERATURE, means greedy decoding."""
    return temperature < GREEDY_BELOW_TEMPERATURE


def nucleus_drop(sorted_probs: Tensor, top_p: float) -> Tensor:
    """The top-p drop rule on probabilities sorted in decreasing order [..., S] -> bool [..., S]: drop a token when
    the mass strictly before it already reaches top_p (so for top_p > 0 the first token always stays)."""
    drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    drop[..., 0] = False  # the most likely token stays even when top_p is below float32's resolution
    return drop


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Top-k then top-p filtering of logits [N, V] (already temperature-scaled); filtered entries become -inf.
    Top-k keeps every logit tied with the k-th largest."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [N, V]
        drop_sorted = nucleus_drop(sorted_logits.softmax(-1), top_p)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def effective_temperature(temperature: float) -> float:
    """The temperature losses and evaluation use: the decode temperature, or 1 for greedy (0 or below the floor)."""
    return 1.0 if is_greedy(temperature) else temperature


def probs(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Logits [N, V] -> float32 probabilities [N, V] under the sampling settings; one-hot at the argmax for
    temperature 0 or below GREEDY_BELOW_TEMPERATURE (the decoder's view)."""
    if is_greedy(temperature):
        out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return filter_logits(logits.float() / temperature, top_k, top_p).softmax(dim=-1)


def log_probs(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Logits [N, V] -> float32 log-probabilities [N, V] under the sampling settings, temperature 0 taken as 1
    (the losses' and evaluation's view)."""
    logits = logits.float() / effective_temperature(temperature)
    return filter_logits(logits, top_k, top_p).log_softmax(dim=-1)


def sample_rows(
    weights: Tensor, k: int, generator: torch.Generator | None = None, u: Tensor | None = None
) -> Tensor:
    """k i.i.d. tokens per row from unnormalised weights [B, V] (each row with positive total) -> [B, k].

    Inverse CDF: one cumsum and a binary search, 10x faster than torch.multinomial for one row of 8192 on CPU
    (20 against 190 us; the decoder samples a few tokens per step). A zero-weight token has an empty CDF interval,
    so it is never drawn; the clamp to the last positive token only catches u rounding up to the total.
    u: the uniforms [B, k] (weights' dtype), drawn by the caller (`row_uniforms`: each row from its own generator,
    as if it were sampled alone); default drawn here from `generator`."""
    cdf = torch.cumsum(weights, -1)  # [B, V]
    total = cdf[:, -1:].contiguous()  # [B, 1]
    if u is None:
        u = torch.rand((weights.shape[0], k), generator=generator, device=weights.device, dtype=weights.dtype)
    idx = torch.searchsorted(cdf, u * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # first index reaching the total: a positive weight
    return torch.minimum(idx, last)


def row_uniforms(generators: list, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """U[0, 1) for a batch of independent rows, each row's block `shape` drawn from its own generator (None: the
    global one) -> [len(generators) * shape[0], *shape[1:]] in `like`'s dtype and device. Row i's block holds the
    numbers torch.rand(shape, generator=generators[i]) gives it alone: a batched computation fed these draws is
    the per-row computation, the same tokens for the same seeds (rows are computed independently, bitwise)."""
    return torch.cat(
        [torch.rand(shape, generator=g, device=like.device, dtype=like.dtype) for g in generators]
    )


def probs_by_settings(logits: Tensor, settings: list[dict]) -> Tensor:
    """`probs` of logits [N, ..., V] where row i has its own sampling settings (settings[i]: temperature, top_k,
    top_p) -> float32 [N, ..., V]; one call per distinct setting (a batch's rows mostly share one)."""
    keys = [tuple(sorted(s.items())) for s in settings]
    if len(set(keys)) == 1:
        return probs(logits.reshape(-1, logits.shape[-1]), **settings[0]).reshape(logits.shape)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for key in dict.fromkeys(keys):
        rows = [i for i, k in enumerate(keys) if k == key]
        part = logits[rows]
        out[rows] = probs(part.reshape(-1, part.shape[-1]), **dict(key)).reshape(part.shape)
    return out


def sample_tokens(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row [N] from probabilities [N, V] (sample_rows)."""
    return sample_rows(probs, 1, generator)[:, 0]


def sample_each(weights: Tensor, generators: list) -> Tensor:
    """One token per row [N] from weights [N, V], row i drawing with generators[i] (row_uniforms): the token
    sample_tokens(weights[i : i + 1], generators[i]) gives it alone."""
    return sample_rows(weights, 1, None, row_uniforms(generators, (1, 1), weights))[:, 0]


def standard_gumbel(
    shape: tuple[int, ...], generator: torch.Generator | None, device=None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Standard Gumbel noise G = -log(-log U), U ~ U[0, 1) in float64 (so the top of G is not quantised: a
    float32 U would leave only ~40 values of G above 13), then cast to dtype. One uniform per entry: on CPU
    ~2x cheaper than -log(E) with E from exponential_ (~25 ns an entry)."""
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float64)
    return (-torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float64).tiny)))).to(dtype)


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SeedStream:
    """A seeded request's randomness keyed by token position (drafter-invariant sampling: Daliri, Musco and
    Suresh, "Coupling without communication and drafter-invariant speculative decoding", 2024).

    The token at absolute position t (its index in prompt + output) is argmax(log p_t + G_t), where the Gumbel
    noise G_t over the vocabulary is a function of (seed, t) alone. By the Gumbel-max trick that is exactly a draw
    from p_t. A speculative decoder drafts with the same G_t (the `gumbel` rule: children = the Gumbel-top-n of
    log q_t + G_t) and verifies by emitting argmax(log p_t + G_t), so the emitted token at every position is the
    one plain sampling with this stream emits: a seeded request decodes the same tokens with or without
    speculation, with any tree, draft or neighbours in a batch. The decoders take a SeedStream wherever they take
    a torch.Generator; a plain Generator keeps the configured rule and consumes its stream in drafting order."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def __repr__(self) -> str:
        return f"SeedStream(seed={self.seed})"

    def gumbel(self, position: int, like: Tensor) -> Tensor:
        """G_position [1, V] (V = like's last dimension), float32, on like's device."""
        gen = torch.Generator(device="cpu").manual_seed(
            _mix64((self.seed * 0x9E3779B97F4A7C15 + position) & _MASK64)
        )
        return standard_gumbel((like.shape[-1],), gen)[None].to(like.device)

    def sample(self, probs: Tensor, position: int) -> Tensor:
        """The token at `position` for every row of probs [N, V] -> [N]: argmax(log p + G_position)."""
        return (torch.log(probs) + self.gumbel(position, probs)).argmax(dim=-1)


def sample_at(probs: Tensor, generator, position: int) -> Tensor:
    """One token per row [N] from probs [N, V] for the token at absolute `position`: a SeedStream's own draw
    there, else sample_tokens with the generator (position unused)."""
    if isinstance(generator, SeedStream):
        return generator.sample(probs, position)
    return sample_tokens(probs, generator)
