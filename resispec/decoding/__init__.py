"""The speculative tree decoder (docs/design.md "Decoder"): SpeculativeDecoder decodes one sequence (a [B > 1] input
raises NotImplementedError); many rows in one forward per step are resispec.decoding.batch's
BatchedSpeculativeDecoder and BatchedDecoder.

    from resispec.decoding import SpeculativeDecoder
    dec = SpeculativeDecoder(target, draft, rule="resispec", tree=[4, 2, 1, 1], tokenizer=tok)
    out = dec.generate(input_ids, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=0,
                       eos_token_id=None, stop=["\\n\\n"], generator=g)
    out.sequences  # [1, L] prompt + generated
    out.stats      # DecodeStats: tau, per_depth_acceptance, c, vLLM counters, seconds
    for chunk in dec.generate_stream(input_ids, ...): ...   # each step's new token ids; stats in dec.last_stats
    dec.generate_autoregressive(input_ids, ...)              # the target-only baseline, same cache path

Stops: `eos_token_id` (None = the target's generation_config; [] = none), `stop` strings (need `tokenizer=`), or
`stop_checker=callable(generated_ids) -> bool`. The token that triggers a stop is the last one emitted; the caller
trims the stop string from the text. Tokenizers: pass `tokenizer_target=` and `tokenizer_draft=` to have them
checked (resispec.models.check_same_tokenizer; TokenizerMismatchError). Temperature 0 = greedy (exactly the
target's greedy output). Timing: `python bench/speed.py`
(`bench.random_pair=true` for a random pair that needs no world).
"""

from resispec.decoding.engine import DecodeOutput, SpeculativeDecoder
from resispec.decoding.stats import DecodeStats
from resispec.decoding.vocab import TokenizerMismatchError

__all__ = [
    "DecodeOutput",
    "DecodeStats",
    "SpeculativeDecoder",
    "TokenizerMismatchError",
]
