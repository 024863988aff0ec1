"""The one adapter between the decoder and transformers' cache objects (5.x `DynamicCache`).

Everything the decoder does to a KV cache goes through here: create, length, crop to a length, compact to a
subset of tree positions, and the 4D tree attention mask plus position ids passed to the model forward.
transformers 5.x returns a 4D `attention_mask` as-is from `create_causal_mask` (a "custom" mask), so an additive
float mask of shape [B, 1, Q, KV] works for both the eager and sdpa attention paths.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty cache laid out for `model`. Only full-attention layers are supported: crop/compact index the
    sequence dim directly, which a sliding-window layer (it keeps only the last window) would break."""
    cache = DynamicCache(config=model.config)
    kinds = {type(layer).__name__ for layer in cache.layers}
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise NotImplementedError(
            f"the tree decoder supports full-attention KV caches only; {type(model).__name__} uses {sorted(kinds)} "
            "(a sliding window is enabled in its config; when prompt + output stay within the window, set "
            "model.config.sliding_window = None before building the decoder)"
        )
    return cache


def cache_length(cache: DynamicCache) -> int:
    """Tokens currently held (layer 0; all full-attention layers agree)."""
    return cache.get_seq_length()


def _layers(cache: DynamicCache):
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
            yield layer


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` tokens (DynamicCache.crop only takes tokens-to-remove, so wrap it here)."""
    for layer in _layers(cache):
        if layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def compact_cache(cache: DynamicCache, start: int, keep_ids: torch.Tensor) -> None:
    """Keep tokens [:start] plus the tokens at `start + keep_ids` (in that order), drop the rest.

    Used after acceptance: `start` is the committed prefix, `keep_ids` [K] the accepted path's offsets inside the tree
    block. No re-encoding: the accepted rows are moved down with one gather per layer, then the cache is truncated.
    """
    num_keep = int(keep_ids.numel())
    for layer in _layers(cache):
        sel = keep_ids + start  # [K]
        # advanced indexing copies first, so the overlapping write below is safe
        layer.keys[..., start : start + num_keep, :] = layer.keys.index_select(-2, sel)
        layer.values[..., start : start + num_keep, :] = layer.values.index_select(-2, sel)
        layer.keys = layer.keys[..., : start + num_keep, :]
        layer.values = layer.values[..., : start + num_keep, :]


def compact_to_path(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Keep cache[:start] + cache[start + keep] (the accepted path); a plain crop when `keep` is 0, 1, 2, ..."""
    if keep == list(range(len(keep))):
        crop_cache(cache, start + len(keep))
    else:
        compact_cache(cache, start, torch.tensor(keep, device=cache.layers[0].keys.device))


def tree_attention_mask(
    prefix_len: int,
    block_mask: torch.Tensor,  # [Q, T] bool: query i may attend to block token j (ancestors + itself)
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive 4D mask [1, 1, Q, prefix_len + T]: every query sees the whole committed prefix, and inside the
    block (tree tokens already in the cache followed by the Q new ones) only what `block_mask` allows."""
    num_q, num_t = block_mask.shape
    mask = torch.zeros(1, 1, num_q, prefix_len + num_t, dtype=dtype, device=block_mask.device)
    mask[0, 0, :, prefix_len:].masked_fill_(~block_mask, torch.finfo(dtype).min)
    return mask


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [1, Q]
    cache: DynamicCache,
    position_ids: torch.Tensor | None = None,  # [1, Q]
    attention_mask: torch.Tensor | None = None,  # [1, 1, Q, KV] additive, or None for plain causal
    logits_to_keep: int = 0,
) -> torch.Tensor:
    """One cached forward; returns logits [1, Q', V] (Q' = logits_to_keep or Q). The cache is extended in place."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits


# ---------------------------------------------------------------------------- batched caches (resispec.decoding.batch)
# A batched cache holds rows right-aligned: row b's tokens are the last `lengths[b]` of the T columns, the columns
# before them are padding that `batch_attention_mask` hides. Rows join (merge_cache_row), leave (select_cache_rows)
# and the padding every row shares is dropped (trim_cache_left), so T stays the longest row's length.


def _kv_pairs(cache: DynamicCache):
    return [(layer.keys, layer.values) for layer in _layers(cache)]


def _set_kv(cache: DynamicCache, pairs) -> None:
    for layer, (keys, values) in zip(cache.layers, pairs, strict=True):
        layer.keys, layer.values = keys, values
        layer.device, layer.is_initialized = keys.device, True


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    if n <= 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:-2], n, t.shape[-1]), t], dim=-2)


def _add_zero_rows(t: torch.Tensor, n: int, front: bool = False) -> torch.Tensor:
    if n <= 0:
        return t
    zeros = t.new_zeros(n, *t.shape[1:])
    return torch.cat([zeros, t] if front else [t, zeros])


def merge_cache_row(cache: DynamicCache, num_rows: int, row_cache: DynamicCache) -> None:
    """Append `row_cache` (batch 1) as row `num_rows` of `cache` (which holds `num_rows` rows, right-aligned),
    left-padding whichever side is shorter. Either side may be empty (uninitialised)."""
    batch, row = _kv_pairs(cache), _kv_pairs(row_cache)
    if not row:  # the new row holds no tokens yet: it owns only padding columns
        if batch:
            _set_kv(cache, [(_add_zero_rows(k, 1), _add_zero_rows(v, 1)) for k, v in batch])
        return
    if not batch:  # the existing rows hold no tokens yet: they get padding columns
        _set_kv(
            cache,
            [
                (_add_zero_rows(k, num_rows, front=True), _add_zero_rows(v, num_rows, front=True))
                for k, v in row
            ],
        )
        return
    t_batch, t_row = batch[0][0].shape[-2], row[0][0].shape[-2]
    _set_kv(
        cache,
        [
            (
                torch.cat([_pad_left(kb, t_row - t_batch), _pad_left(kr, t_batch - t_row)]),
                torch.cat([_pad_left(vb, t_row - t_batch), _pad_left(vr, t_batch - t_row)]),
            )
            for (kb, vb), (kr, vr) in zip(batch, row, strict=True)
        ],
    )


def select_cache_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep the batch rows `rows` [R] (in that order)."""
    for layer in _layers(cache):
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


def trim_cache_left(cache: DynamicCache, num: int) -> None:
    """Drop the first `num` columns (padding that no row uses any more)."""
    if num > 0:
        for layer in _layers(cache):
            layer.keys = layer.keys[..., num:, :]
            layer.values = layer.values[..., num:, :]


def batch_attention_mask(
    lengths: torch.Tensor, num_cached: int, num_new: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive 4D mask [B, 1, Q, T + Q] for Q new tokens per row after a right-aligned cache of T columns in
    which row b owns the last lengths[b]: a row sees its own cached tokens and its new tokens causally."""
    dev = lengths.device
    col = torch.arange(num_cached + num_new, device=dev)  # [T + Q]
    q = torch.arange(num_new, device=dev)  # [Q]
    own = col[None, :] >= (num_cached - lengths)[:, None]  # [B, T + Q]
    causal = col[None, :] < (num_cached + q + 1)[:, None]  # [Q, T + Q]
    allowed = own[:, None, :] & causal[None, :, :]  # [B, Q, T + Q]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def gather_cache_columns(cache: DynamicCache, index: torch.Tensor) -> None:
    """Row b keeps columns index[b] (in that order): index [B, T'] long. Used to repack a batch cache whose rows
    have holes (rejected tree nodes) into right-aligned rows."""
    for layer in _layers(cache):
        k, v = layer.keys, layer.values
        layer.keys = k.gather(2, index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1]))
        layer.values = v.gather(2, index[:, None, :, None].expand(-1, v.shape[1], -1, v.shape[-1]))
