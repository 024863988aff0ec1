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
    sel = keep_ids + start  # [K]
    for layer in _layers(cache):
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


# ---------------------------------------------------------------------------- buffers with spare room
# The decoder's forward (resispec.decoding.fast_forward) appends K/V IN PLACE into a buffer with spare rows and
# columns: a layer's `keys` / `values` are then views buf[:B, :, c0 : c0 + L, :] of it. Every edit below keeps them
# views where it can: an append writes after the last column, a crop or a trim of leading padding moves the view's
# ends, a joining row is written into a spare row, a leaving row's slot is filled by moving one row. So neither a
# step nor a join or leave copies the whole cache (at 15 rows of the tiny target, joining and leaving used to cost
# four whole-cache copies, ~25 ms, most of an AR step). A layer holding a plain tensor (HF's DynamicCache.update
# concatenates) is copied into a fresh buffer by the next edit that needs room.


def _capacity(needed: int) -> int:
    """Columns to allocate for `needed`: spare room for 64 tokens or half as many again, rounded to 64."""
    return -(-(needed + max(64, needed // 2)) // 64) * 64


def _row_capacity(rows: int) -> int:
    """Rows to allocate for `rows`: room for half as many again (at least 2) to join without a copy."""
    return rows + max(2, rows // 2)


def _buffer_name(name: str) -> str:
    return "_resispec_" + name


def _in_buffer(layer, name: str) -> tuple[torch.Tensor, int] | None:
    """(buffer, first column c0) when layer.<name> is the view buf[:B, :, c0 : c0 + L, :] of its buffer, else None.
    A buffer that no longer holds the tensor (HF's forward concatenated a new one) is released."""
    view, buf = getattr(layer, name, None), getattr(layer, _buffer_name(name), None)
    if buf is None or view is None or view.numel() == 0:
        return None
    if view.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        setattr(layer, _buffer_name(name), None)
        return None
    if view.stride() != buf.stride():
        return None
    if view.shape[0] > buf.shape[0] or view.shape[1] != buf.shape[1] or view.shape[-1] != buf.shape[-1]:
        return None
    offset, col = view.storage_offset() - buf.storage_offset(), buf.stride(-2)
    if offset < 0 or offset % col or offset // col + view.shape[-2] > buf.shape[-2]:
        return None
    return buf, offset // col


def _set_view(layer, name: str, buf: torch.Tensor, rows: int, c0: int, length: int) -> torch.Tensor:
    view = buf[:rows, :, c0 : c0 + length, :]
    setattr(layer, name, view)
    setattr(layer, _buffer_name(name), buf)
    layer.device, layer.is_initialized = buf.device, True
    return view


def _fresh(layer, name: str, like: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """A new buffer for `rows` x `length` (spare rows kept from the layer's old buffer, spare columns added)."""
    old = getattr(layer, _buffer_name(name), None)
    spare_rows = old.shape[0] if old is not None and old.shape[1:2] == like.shape[1:2] else 0
    return like.new_empty(max(rows, spare_rows), like.shape[1], _capacity(length), like.shape[-1])


def append_kv(layer, name: str, new: torch.Tensor) -> torch.Tensor:
    """Append `new` [B, H, Q, D] to the layer's `keys` or `values` in place -> the full view [B, H, L + Q, D]."""
    old = getattr(layer, name)
    length = 0 if old is None or old.numel() == 0 else old.shape[-2]
    rows, needed = new.shape[0], length + new.shape[-2]
    at = _in_buffer(layer, name) if length else None
    if at is not None and at[0].shape[0] >= rows and at[1] + needed <= at[0].shape[-2]:
        buf, c0 = at
    else:
        buf, c0 = _fresh(layer, name, new, rows, needed), 0
        if length:
            buf[:rows, :, :length] = old
    buf[:rows, :, c0 + length : c0 + needed] = new
    return _set_view(layer, name, buf, rows, c0, needed)


# ---------------------------------------------------------------------------- batched caches (resispec.decoding.batch)
# A batched cache holds rows right-aligned: row b's tokens are the last `lengths[b]` of the T columns, the columns
# before them are padding that `batch_attention_mask` hides. Rows join (merge_cache_row), leave (select_cache_rows)
# and the padding every row shares is dropped (trim_cache_left), so T stays the longest row's length.


def _merge_layer(layer, name: str, num_rows: int, row: torch.Tensor | None) -> None:
    """Row `num_rows` joins layer.<name> (`num_rows` rows of T columns, maybe none yet): `row` [1, H, t, D]
    right-aligned, or only padding when `row` is None. Padding is zeros (finite under the additive mask)."""
    old = getattr(layer, name, None)
    batch = old if old is not None and old.numel() > 0 else None
    if batch is None and row is None:
        return
    t_batch = 0 if batch is None else batch.shape[-2]
    t_row = 0 if row is None else row.shape[-2]
    width = max(t_batch, t_row)
    at = _in_buffer(layer, name) if batch is not None else None
    if at is not None and at[0].shape[0] > num_rows and at[1] >= width - t_batch:
        buf, c0 = at
        start = c0 - (width - t_batch)
        buf[:num_rows, :, start:c0] = 0  # the existing rows' new padding (none unless the row is the longest)
    else:
        like = batch if batch is not None else row
        buf = _fresh(layer, name, like, _row_capacity(num_rows + 1), width)
        start = 0
        buf[:num_rows, :, : width - t_batch] = 0
        if batch is not None:
            buf[:num_rows, :, width - t_batch : width] = batch
    buf[num_rows, :, start : start + width - t_row] = 0
    if row is not None:
        buf[num_rows, :, start + width - t_row : start + width] = row[0]
    _set_view(layer, name, buf, num_rows + 1, start, width)


@torch.inference_mode()  # writes into the decoders' inference-mode buffers
def merge_cache_row(cache: DynamicCache, num_rows: int, row_cache: DynamicCache) -> None:
    """Append `row_cache` (batch 1) as row `num_rows` of `cache` (which holds `num_rows` rows, right-aligned),
    left-padding whichever side is shorter. Either side may be empty (uninitialised). Into a spare row of the
    batch's buffer when it has one and no existing row needs new padding (else one copy into a bigger buffer)."""
    row_layers = list(_layers(row_cache))
    for i, layer in enumerate(cache.layers):
        src = row_layers[i] if row_layers else None
        for name in ("keys", "values"):
            _merge_layer(layer, name, num_rows, None if src is None else getattr(src, name))


def cache_of(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache holding these per-layer (keys, values) tensors as they are (views stay views: a forward appending
    to it copies them into a buffer of its own, append_kv; merge_cache_row copies them into the batch)."""
    cache = DynamicCache()
    cache.layers = []
    for keys, values in layers:
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


def split_cache_rows(cache: DynamicCache, lengths: list[int]) -> list[DynamicCache]:
    """Row b of a batch cache whose rows are right-aligned (row b owns the last lengths[b] columns) as a batch-1
    cache of its own, for merge_cache_row: views, no copy (a batched prefill of several prompts, split)."""
    t = cache.layers[0].keys.shape[-2]
    return [
        cache_of(
            [
                (layer.keys[b : b + 1, :, t - n :], layer.values[b : b + 1, :, t - n :])
                for layer in cache.layers
            ]
        )
        for b, n in enumerate(lengths)
    ]


@torch.inference_mode()  # writes into the decoders' inference-mode buffers
def select_cache_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep the batch rows `rows` [R] (in that order). In the buffer, only the rows whose slot changes are moved
    (the batched decoders order their rows so that one row fills each slot that was left)."""
    dst = torch.arange(rows.numel(), device=rows.device)
    moved = rows != dst
    src, dst = rows[moved], dst[moved]
    for layer in _layers(cache):
        for name in ("keys", "values"):
            at = _in_buffer(layer, name)
            view = getattr(layer, name)
            if at is None:
                setattr(layer, name, view.index_select(0, rows))
                continue
            buf, c0 = at
            cols = slice(c0, c0 + view.shape[-2])
            if src.numel():
                buf[dst, :, cols] = buf[src, :, cols]  # the right side is gathered first: overlap is safe
            _set_view(layer, name, buf, rows.numel(), c0, view.shape[-2])


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


@torch.inference_mode()  # writes into the decoders' inference-mode buffers
def gather_cache_columns(cache: DynamicCache, index: torch.Tensor) -> None:
    """Row b keeps columns index[b] (in that order): index [B, T'] long. Used to repack a batch cache whose rows
    have holes (rejected tree nodes) into right-aligned rows."""
    for layer in _layers(cache):
        for name in ("keys", "values"):
            t = getattr(layer, name)
            packed = t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))
            at = _in_buffer(layer, name)
            if at is None:
                setattr(layer, name, packed)
            else:  # back into the buffer, from its first column
                buf, c0 = at
                buf[: t.shape[0], :, c0 : c0 + packed.shape[-2]] = packed
                _set_view(layer, name, buf, t.shape[0], c0, packed.shape[-2])
