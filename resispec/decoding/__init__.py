"""The speculative tree decoder: `SpeculativeDecoder(target, draft, rule=..., tree=[...]).generate(...)`."""

from resispec.decoding.engine import DecodeOutput, SpeculativeDecoder
from resispec.decoding.sampling import process_logits
from resispec.decoding.stats import DecodeStats
from resispec.decoding.tokenizers import TokenizerMismatchError

__all__ = ["DecodeOutput", "DecodeStats", "SpeculativeDecoder", "TokenizerMismatchError", "process_logits"]
