"""The target's log-probabilities of emitted (and, with `echo`, prompt) tokens: OpenAI/vLLM `logprobs`.

Exact and simple: a `Scorer` keeps its own KV cache of the TARGET for one request and runs it over the prompt, then
over each chunk of emitted tokens (on the decoding worker's thread, which owns the models). The log-probs are the
sampling transform's log view (`resispec.sampling.log_probs`: the request's temperature, top-k and top-p; greedy
requests score at temperature 1, as vLLM reports raw log-probs), so they equal what plain autoregressive decoding
with the same settings computes at every position, whichever rule and tree emitted the tokens. A request that asks
for no log-probs costs nothing.

Formatting follows vLLM: completions get `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (the echoed
first prompt token has no log-prob: null), chat gets `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.
A log-prob of -inf (a token the request's top-k / top-p excludes) is reported as -9999.0, as vLLM does (JSON has no
infinity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from resispec.decoding.kv_cache import forward_logits
from resispec.sampling import log_probs

# what JSON gets for -inf (vLLM's floor)
LOGPROB_FLOOR = -9999.0
# rows of [L, V] logits turned into log-probs at once when scoring an echoed prompt (bounds the float32 copy)
_ROWS = 256


@dataclass
class TokenLogprob:
    """One position: the token, its log-prob (None: the first prompt token, which has no context) and the k most
    likely tokens there as (id, log-prob), most likely first."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class Scorer:
    """Scores one request's tokens with the target. `prompt` holds the echoed prompt's entries (or None)."""

    def __init__(
        self,
        model,
        prompt_ids: Sequence[int],
        num_top: int,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        echo: bool = False,
    ) -> None:
        self.model, self.num_top = model, num_top
        self.settings = dict(temperature=temperature, top_k=max(top_k, 0), top_p=top_p)
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        logits = self._forward(prompt_ids, all_rows=echo)  # [L or 1, V]
        self.prompt: list[TokenLogprob] | None = None
        if echo:
            self.prompt = [TokenLogprob(int(prompt_ids[0]), None)]
            self.prompt += self._entries(logits[:-1], prompt_ids[1:])
        self.next_logits = logits[-1:]  # [1, V]: predicts the next token

    @torch.inference_mode()
    def _forward(self, ids: Sequence[int], all_rows: bool = True) -> torch.Tensor:
        ids_t = torch.tensor([list(ids)], device=self.device)  # [1, n]
        return forward_logits(self.model, ids_t, self.cache, logits_to_keep=0 if all_rows else 1)[0]  # [n, V]

    def add(self, chunk: Sequence[int]) -> list[TokenLogprob]:
        """Entries of newly emitted tokens (in order; call with every chunk the request emits)."""
        logits = self._forward(chunk)  # [n, V]: row i predicts chunk[i+1]; the last row the next token
        rows = torch.cat([self.next_logits, logits[:-1]])
        self.next_logits = logits[-1:]
        return self._entries(rows, chunk)

    @torch.inference_mode()
    def _entries(self, logits: torch.Tensor, ids: Sequence[int]) -> list[TokenLogprob]:
        out: list[TokenLogprob] = []
        for start in range(0, len(ids), _ROWS):
            rows = log_probs(logits[start : start + _ROWS], **self.settings)  # [n, V] float32
            chosen = torch.tensor(list(ids[start : start + _ROWS]), device=rows.device)
            lps = rows.gather(-1, chosen[:, None])[:, 0].tolist()
            if self.num_top > 0:
                k = min(self.num_top, rows.shape[-1])
                top_v, top_i = (t.tolist() for t in rows.topk(k, dim=-1))
            for j, tok in enumerate(chosen.tolist()):
                top = list(zip(top_i[j], map(_finite, top_v[j]), strict=True)) if self.num_top > 0 else []
                out.append(TokenLogprob(tok, _finite(lps[j]), top))
        return out


def scoring_model(engine):
    """The target model an engine scores with (`engine.decoder.target` or `engine.target`), or None."""
    return getattr(getattr(engine, "decoder", None), "target", None) or getattr(engine, "target", None)


def start_scoring(engine, prompt_ids: Sequence[int], params) -> Scorer | None:
    """The Scorer a request needs (`params.logprobs` set), else None. Runs the prompt through the target."""
    if getattr(params, "logprobs", None) is None:
        return None
    model = scoring_model(engine)
    if model is None:
        raise NotImplementedError(f"{type(engine).__name__} cannot score log-probs (it exposes no target)")
    return Scorer(
        model,
        prompt_ids,
        params.logprobs,
        params.temperature,
        params.top_k,
        params.top_p,
        echo=getattr(params, "echo", False),
    )


# ---------------------------------------------------------------- OpenAI shapes


class TokenText:
    """Token id -> its text (cached), as vLLM renders single tokens (special tokens kept)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_text: TokenText, offset: int = 0
) -> dict[str, Any]:
    """Completions' `choices[i].logprobs`; `offset` is the text offset of the first entry."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for e in entries:
        text = token_text(e.token_id)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        if e.logprob is None:
            top_logprobs.append(None)
        else:
            top = {token_text(i): lp for i, lp in e.top}
            top.setdefault(text, e.logprob)  # the emitted token is always listed (vLLM)
            top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """Chat's `choices[i].logprobs`."""
    return {
        "content": [
            {
                **_chat_token(token_text(e.token_id), e.logprob),
                "top_logprobs": [_chat_token(token_text(i), lp) for i, lp in e.top],
            }
            for e in entries
        ]
    }
