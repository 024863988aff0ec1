"""Batched decoding, the public face: many rows, ONE target forward per step (docs/design.md "Batched decoding and
scheduling").

  BatchedDecoder             autoregressive (resispec/decoding/batch_ar.py)
  BatchedSpeculativeDecoder  speculative: per-row draft trees, one draft forward per depth (batch_spec.py)
  BatchRow, PartialPrefill   a row of either, a prompt's chunked prefill (batch_rows.py, with RowBatch: the row API
                             both share: add / add_many / prefill_part / remove / generate)
"""

from resispec.decoding.batch_ar import BatchedDecoder
from resispec.decoding.batch_rows import BatchRow, PartialPrefill, RowBatch
from resispec.decoding.batch_spec import BatchedSpeculativeDecoder

__all__ = ["BatchRow", "BatchedDecoder", "BatchedSpeculativeDecoder", "PartialPrefill", "RowBatch"]
