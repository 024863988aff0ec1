"""The decoder's own forward for Llama-family causal LMs: the HF model's weights, fewer ops, no cat per step.

Why: on CPU at these sizes the HF forward spends much of a step on host work, and on matmul shapes that suit one
row but not the 2-32 rows of a tree verify or a batch (the measurements: docs/journal/docstrings.md). So:
  - no module call stack, no mask builder, no torch.cat of the whole cache per step (`DynamicCache.update`);
  - a linear multiplies as W @ x^T (the weight as the left operand), which costs about one row's time for a few
    rows where x @ W^T does not; row counts just short of a multiple of 8 are padded with zero rows (W @ x^T has a
    cliff there). Weights under `_WXT_MIN_BYTES` skip this form: their product is all per-call cost, which the
    form's extra ops (repeat, transposes, slice) raise;
  - a float32 linear whose weight is 512 KB or more multiplies by a copy of the weight packed in oneDNN's blocked
    layout (`torch.ops.mkldnn`, what inductor's CPU freezing and vLLM's CPU backend use), so it is not repacked on
    every call; smaller weights lose to oneDNN's per-call cost and are not packed;
  - q/k/v and gate/up are multiplied as one fused weight each (copies, rebuilt when the model's weights change; only
    while the copies stay under FUSE_MAX_BYTES, since for a large model the weights' streaming dominates and the
    copy would cost memory for nothing);
  - q is made contiguous: the W @ x^T product leaves the rows as the fastest dim, and SDPA's CPU flash kernel
    otherwise falls back to its math path.
Here: one RMSNorm op, the rotary table from the model's own `rotary_emb`, SDPA with the decoder's 4D mask, and K/V
appended IN PLACE into a buffer with spare rows and columns (`kv_cache.append_kv`: the cache layer's `keys` /
`values` stay views of it, which every edit of resispec.decoding.kv_cache, crop, compaction, a row joining or
leaving, repack, keeps where it can; a layer whose tensors were replaced by something else is copied into a fresh
buffer on its next append).

Exactness: the same math as the HF forward in the same dtype. Logits differ from HF's by float rounding only
(the order of a few reductions), like any change of batch shape; tests/unit/test_fast_forward.py holds logits
and cache contents to HF's on every path (prefill, one token, tree mask, ragged batch, GQA, biases, q/k norms).

Supported: `model_type` llama, mistral, qwen2, qwen3 with SiLU MLPs and full attention (what `new_cache` accepts).
Anything else (peft wrappers or LoRA-injected layers, quantized linears, other architectures, torch.compile'd
modules) runs the HF forward: `fast_forward` returns the model itself. On CUDA the W @ x^T trick and the fused and
packed copies are off (cuBLAS has no such cliff) and the rest still applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from resispec.decoding.kv_cache import append_kv
from resispec.models.head import is_head
from resispec.models.head import rms_norm as _rms
from resispec.models.head import rotate as _rotate

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# q/k/v and gate/up are fused (copied side by side) on CPU while the copies stay under this size
FUSE_MAX_BYTES = 1 << 30
# up to this many rows a CPU matmul is computed as W @ x^T (see the module docstring); beyond it x @ W^T is as fast
_WXT_MAX_ROWS = 128
# ... and only for weights of at least this size: below it the product is all per-call cost, and the W @ x^T form's
# extra ops (repeat, transposes, slice) cost more than it saves (see the module docstring)
_WXT_MIN_BYTES = 512 << 10
# a float32 CPU matmul uses the oneDNN-prepacked copy of its weight (see the module docstring) for weights of at
# least this size (below it oneDNN's per-call cost outweighs its better blocking)
_PACK_MIN_BYTES = 512 << 10
_PACK_BATCH_HINT = 32
_NOT_PACKED = (None, None, None, None)


@dataclass
class FastOutput:
    logits: torch.Tensor
    hidden: torch.Tensor | None = None  # [B, Q, k*H]: the residual stream entering the `capture` layers


def _unsupported_reason(model) -> str | None:
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attn_implementation {cfg._attn_implementation!r}"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} does not have the Llama module layout"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention modules differ from Llama's"
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            return "MLP modules differ from Llama's"
        projections = [getattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")]
        if any(type(p) is not torch.nn.Linear for p in projections):  # e.g. peft's LoRA layers: their delta
            return "a projection is not a plain nn.Linear (LoRA-injected or quantized)"
    return None


def fast_forward(model):
    """The decoder's forward for `model`: a cached `FastCausalLM` where the architecture is supported, a `FastHead`
    for a draft head, else the model itself (the HF forward). A causal LM's is called as `fwd(input_ids=, attention_mask=, position_ids=, cache=,
    logits_to_keep=)` and return an object with `.logits` (resispec.decoding.kv_cache.forward_logits)."""
    if isinstance(model, (FastCausalLM, FastHead)):
        return model
    fast = getattr(model, "_resispec_fast_forward", None)
    if fast is None:
        if is_head(model):
            fast = FastHead(model)
        else:
            fast = FastCausalLM(model) if _unsupported_reason(model) is None else model
        # past nn.Module.__setattr__: the model itself must not become its own submodule (state_dict, .to())
        object.__setattr__(model, "_resispec_fast_forward", fast)
    return fast


def _can_pack(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear exists in this torch build (x86 and aarch64 CPU wheels) for this dtype."""
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """W in oneDNN's blocked layout for x @ W^T (a copy, the weight's own storage untouched); None for a small W."""
    if weight.numel() * weight.element_size() < _PACK_MIN_BYTES:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,  # None only with `packed`
    bias: torch.Tensor | None,
    wxt: bool,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    rows = x.numel() // x.shape[-1]
    if wxt and rows <= _WXT_MAX_ROWS and weight.numel() * weight.element_size() >= _WXT_MIN_BYTES:
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:  # MKL's sgemv streams the weight at half the speed of a two-column sgemm: feed x twice
            flat = flat.repeat(2, 1)
        elif rows > 8 and 0 < -rows % 8 <= 3:  # 13-15, 21-23, ... rows: pad with zero rows to a multiple of 8
            flat = F.pad(flat, (0, 0, 0, -rows % 8))
        out = (weight @ flat.T)[:, :rows].T.reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def _concat(
    linears: list[tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) pairs -> one (weight, bias) whose output is theirs side by side (a missing bias is zeros)."""
    weight = torch.cat([w.detach() for w, _ in linears])
    if all(b is None for _, b in linears):
        return weight, None
    return weight, torch.cat([w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in linears])


def _version(t: torch.Tensor) -> int | None:
    """In-place edits bump a tensor's version counter; an inference tensor (made under inference_mode) has none."""
    return None if t.is_inference() else t._version


def _snapshot(sources: list) -> list:
    """What `_changed` compares: each source tensor with its version and storage."""
    return [(t, _version(t), t.data_ptr()) for t in sources if t is not None]


def _changed(snapshot: list) -> bool:
    """A tensor of `snapshot` was edited in place or its storage replaced (e.g. a checkpoint loaded, .to())."""
    return any(_version(t) != version or t.data_ptr() != ptr for t, version, ptr in snapshot)


def _cached_attention(layer, q, k, v, attention_mask, causal: bool, scale: float, gqa: bool) -> torch.Tensor:
    """k and v [B, kv_heads, n, hd] appended in place to the cache `layer` (initialised on first use), then q
    attending over every cached key: [B, heads, n, hd]."""
    if not layer.is_initialized:
        layer.lazy_initialization(k, v)
    keys, values = append_kv(layer, "keys", k), append_kv(layer, "values", v)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=attention_mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )


def _positions_and_mask(input_ids: torch.Tensor, attention_mask, position_ids, cache) -> tuple:
    """(position ids [B, Q], the mask): positions after the cache when none are given; without a mask, Q > 1 new
    tokens after a non-empty cache get the causal one aligned to the cache's end (an empty cache: SDPA's is_causal)."""
    if cache is None:
        raise ValueError("the fast forward needs a cache (resispec.decoding.kv_cache.new_cache)")
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError("the fast forward takes a 4D attention mask [B, 1, Q, KV] or None")
    bsz, num_q = input_ids.shape
    past = cache.get_seq_length()
    if position_ids is None:
        position_ids = torch.arange(past, past + num_q, device=input_ids.device)[None].expand(bsz, -1)
    if attention_mask is None and num_q > 1 and past > 0:  # causal, aligned to the end of the cache
        col = torch.arange(past + num_q, device=input_ids.device)
        attention_mask = (col[None, :] <= past + torch.arange(num_q, device=input_ids.device)[:, None])[
            None, None
        ]
    return position_ids, attention_mask


class FastCausalLM:
    """Cached forward of a Llama-family `model` (see the module docstring), reading the model's own parameters."""

    def __init__(self, model) -> None:
        reason = _unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no fast forward for {type(model).__name__}: {reason}")
        self.model = model
        self.config = cfg = model.config
        base = model.model
        self.embed = base.embed_tokens.weight
        self.rotary = base.rotary_emb
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.head = model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        attn0 = base.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.scaling = attn0.scaling
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.layers.append(
                (
                    (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                    [(p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)],
                    None
                    if q_norm is None
                    else ((q_norm.weight, q_norm.variance_epsilon), (k_norm.weight, k_norm.variance_epsilon)),
                    (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                    [(p.weight, p.bias) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)],
                )
            )

        def nbytes(linears) -> int:
            return sum(w.numel() * w.element_size() for w, _ in linears)

        fused_bytes = sum(nbytes([*attn_p[:3], *mlp_p[:2]]) for _, attn_p, _, _, mlp_p in self.layers)
        linear_bytes = nbytes([(self.head.weight, None)]) + sum(
            nbytes(attn_p + mlp_p) for _, attn_p, _, _, mlp_p in self.layers
        )
        # fused and packed copies are made on CPU only (_fuse turns them off elsewhere) and only while they stay
        # small: for a large model the weights' streaming dominates and a copy would cost memory for nothing
        self.fuse = fused_bytes <= FUSE_MAX_BYTES
        self.pack = linear_bytes <= FUSE_MAX_BYTES  # packed copies of every linear (float32 only: _fuse)
        # per layer: (fused q/k/v, fused gate/up), each a (weight, bias), the weight None where it is packed; see _fuse
        self._fused: list = []
        # per layer: the oneDNN-packed (q/k/v, o, gate/up, down) weights, then the head's; empty when not packing
        self._packed: list = []
        self._packed_head: torch.Tensor | None = None
        self._fused_from: list = []  # the parameters the copies were made from, with their versions
        if self.fuse:
            self._fuse()

    def _fuse(self) -> None:
        """Concatenate each layer's q/k/v and gate/up weights: one matmul each instead of three and two (on CPU a
        small matmul costs ~25 us of dispatch and layout around it, 36 of them per step of the 12-layer target).
        For float32, also pack every linear's weight (fused ones included) in oneDNN's blocked layout (`_pack`).
        These are copies, so the parameters they came from are remembered with their version counters and the copies
        are rebuilt when any of them was changed in place or replaced (`_stale`)."""
        self._fused, self._packed, self._packed_head, self._fused_from = [], [], None, []
        if self.embed.device.type != "cpu":  # on CUDA, or moved there after the forward was built
            self.fuse = False
            return
        pack = self.pack and _can_pack(self.embed.dtype)
        sources = [self.head.weight] if pack else []
        with torch.no_grad():
            for _, (q_p, k_p, v_p, o_p), _, _, (g_p, u_p, d_p) in self.layers:
                qkv, gate_up = _concat([q_p, k_p, v_p]), _concat([g_p, u_p])
                sources += [t for w, b in (q_p, k_p, v_p, g_p, u_p) for t in (w, b)]
                if pack:
                    packed = tuple(_pack(w) for w, _ in (qkv, o_p, gate_up, d_p))
                    self._packed.append(packed)
                    sources += [o_p[0], d_p[0]]
                    # a fused weight with a packed copy is never read again (_linear takes the copy): keep its bias
                    qkv = qkv if packed[0] is None else (None, qkv[1])
                    gate_up = gate_up if packed[2] is None else (None, gate_up[1])
                self._fused.append((qkv, gate_up))
            if pack:
                self._packed_head = _pack(self.head.weight)
        self._fused_from = _snapshot(sources)

    def _stale(self) -> bool:
        # not built yet (a deep copy or an unpickled one: __getstate__), or built from other weights
        return not self._fused or _changed(self._fused_from)

    def __getstate__(self) -> dict:
        """Deep copies and pickles of the model carry this forward (it sits in the model's __dict__) without the
        copies: oneDNN's packed tensors can be neither copied nor pickled, and the copy rebuilds them on first use."""
        return {**self.__dict__, "_fused": [], "_packed": [], "_packed_head": None, "_fused_from": []}

    def __call__(
        self,
        input_ids: torch.Tensor,  # [B, Q]
        attention_mask: torch.Tensor | None = None,  # [B, 1, Q, L+Q] additive or bool, or None (causal)
        position_ids: torch.Tensor | None = None,  # [B, Q]
        cache=None,  # DynamicCache (resispec.decoding.kv_cache.new_cache), extended in place
        use_cache: bool = True,
        logits_to_keep: int = 0,
        capture: tuple[int, ...] | None = None,  # layers whose input states to return (a head's features)
        **_,
    ) -> FastOutput:
        bsz, num_q = input_ids.shape
        position_ids, attention_mask = _positions_and_mask(input_ids, attention_mask, position_ids, cache)
        causal = attention_mask is None and num_q > 1
        wxt = input_ids.device.type == "cpu"
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(x, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        heads, kv_heads, hd = self.num_heads, self.num_kv, self.head_dim
        gqa = kv_heads != heads
        if self.fuse and self._stale():  # the weights changed since the copies were made (or none were)
            self._fuse()
        captured = {}
        for i, (ln1, (q_p, k_p, v_p, o_p), qk_norm, ln2, (g_p, u_p, d_p)) in enumerate(self.layers):
            if capture is not None and i in capture:
                captured[i] = x
            packed = self._packed[i] if self._packed else _NOT_PACKED
            h = _rms(x, *ln1)
            if self.fuse:
                qkv = _linear(h, *self._fused[i][0], wxt, packed[0]).reshape(
                    bsz, num_q, heads + 2 * kv_heads, hd
                )
                qk, v = qkv[:, :, : heads + kv_heads], qkv[:, :, heads + kv_heads :]
            else:
                q = _linear(h, *q_p, wxt).reshape(bsz, num_q, heads, hd)
                qk = torch.cat([q, _linear(h, *k_p, wxt).reshape(bsz, num_q, kv_heads, hd)], dim=2)
                v = _linear(h, *v_p, wxt).reshape(bsz, num_q, kv_heads, hd)
            if qk_norm is not None:
                q, k = _rms(qk[:, :, :heads], *qk_norm[0]), _rms(qk[:, :, heads:], *qk_norm[1])
                qk = torch.cat([q, k], dim=2)
            qk = _rotate(qk.transpose(1, 2), cos, sin)  # q's and k's heads in one go
            # contiguous: the W @ x^T product leaves rows as the fastest dim, and SDPA's CPU flash kernel needs a
            # contiguous last dim (else the math path: 2-3x the attention time at 16 rows)
            q, k, v = qk[:, :heads].contiguous(), qk[:, heads:], v.transpose(1, 2)
            a = _cached_attention(cache.layers[i], q, k, v, attention_mask, causal, self.scaling, gqa)
            x = x + _linear(a.transpose(1, 2).reshape(bsz, num_q, heads * hd), *o_p, wxt, packed[1])
            h = _rms(x, *ln2)
            if self.fuse:
                gate, up = _linear(h, *self._fused[i][1], wxt, packed[2]).chunk(2, dim=-1)
            else:
                gate, up = _linear(h, *g_p, wxt), _linear(h, *u_p, wxt)
            x = x + _linear(F.silu(gate) * up, *d_p, wxt, packed[3])
        hidden = torch.cat([captured[i] for i in capture], dim=-1) if capture is not None else None
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return FastOutput(
            _linear(_rms(x, *self.norm), self.head.weight, self.head.bias, wxt, self._packed_head), hidden
        )


class FastHead:
    """The decoder's forward for a draft head (resispec/models/head.py `DraftHead`): `fuse`, `step`, `logits` and
    `target_logits` with the head's math through this module's linears (packed or W @ x^T on CPU, as the target's),
    q/k/v and gate/up fused, K/V appended in place (`step` needs a cache). Every other attribute is the head's.
    Without this the head's draft phase cost ~3x the standalone draft's per forward on the tiny world (its LM head
    alone is the target's width x 8192, multiplied unpacked): docs/draft_heads.md."""

    def __init__(self, head) -> None:
        self.head = head
        self._linears: list = []  # fc, q/k/v, o, gate/up, down, lm_head: each (weight, bias, packed or None)
        self._from: list = []  # the parameters the copies were made from (_snapshot)

    def __getattr__(self, name: str):
        head = self.__dict__.get("head")
        if head is None:  # copy / pickle probing a half-built instance
            raise AttributeError(name)
        return getattr(head, name)

    def __getstate__(self) -> dict:
        """As FastCausalLM's: oneDNN's packed copies are neither copied nor pickled; the copy rebuilds them."""
        return {**self.__dict__, "_linears": [], "_from": []}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def _build(self) -> None:
        head = self.head
        attn, mlp = head.midlayer.self_attn, head.midlayer.mlp
        with torch.no_grad():
            qkv, _ = _concat([(p.weight, None) for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
            gate_up, _ = _concat([(p.weight, None) for p in (mlp.gate_proj, mlp.up_proj)])
            weights = [
                head.fc.weight,
                qkv,
                attn.o_proj.weight,
                gate_up,
                mlp.down_proj.weight,
                head.lm_head.weight,
            ]
            pack = head.fc.weight.device.type == "cpu" and _can_pack(head.fc.weight.dtype)
            self._linears = [(w, None, _pack(w) if pack else None) for w in weights]
        self._from = _snapshot([p for p in head.parameters()])

    def _weights(self) -> list:
        """The copies, rebuilt when the head's parameters changed since they were made (checked once per call)."""
        if not self._linears or _changed(self._from):
            self._build()
        return self._linears

    @staticmethod
    def _lin(x: torch.Tensor, linear: tuple) -> torch.Tensor:
        weight, bias, packed = linear
        return _linear(x, weight, bias, x.device.type == "cpu", packed)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self._lin(features.to(self.head.dtype), self._weights()[0])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        norm = self.head.norm
        return self._lin(_rms(h, norm.weight, norm.eps), self._weights()[5])

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_vocab(self.logits(h))

    def step(self, hidden, ids, position_ids, cache, attention_mask=None) -> torch.Tensor:
        """DraftHead.step with a cache: hidden [B, Q, H], ids and position_ids [B, Q], attention_mask 4D over
        cache + new or None (causal) -> the pre-norm outputs [B, Q, H]."""
        head, (_, qkv_w, o_w, gate_up_w, down_w, _) = self.head, self._weights()
        layer = head.midlayer
        bsz, num_q = ids.shape
        position_ids, attention_mask = _positions_and_mask(ids, attention_mask, position_ids, cache)
        e = F.embedding(ids, head._embed).to(hidden.dtype)
        ln1, ln_h = layer.input_layernorm, layer.hidden_norm
        x = torch.cat([_rms(e, ln1.weight, ln1.eps), _rms(hidden, ln_h.weight, ln_h.eps)], dim=-1)
        heads, kv_heads, hd = head.num_heads, head.num_kv, head.head_dim
        qkv = self._lin(x, qkv_w).reshape(bsz, num_q, heads + 2 * kv_heads, hd)
        cos, sin = head.rotary(x, position_ids)
        qk = _rotate(qkv[:, :, : heads + kv_heads].transpose(1, 2), cos[:, None], sin[:, None])
        q, k, v = qk[:, :heads].contiguous(), qk[:, heads:], qkv[:, :, heads + kv_heads :].transpose(1, 2)
        causal = attention_mask is None and num_q > 1
        a = _cached_attention(
            cache.layers[0], q, k, v, attention_mask, causal, head.scaling, kv_heads != heads
        )
        h = hidden + self._lin(a.transpose(1, 2).reshape(bsz, num_q, heads * hd), o_w)
        ln2 = layer.post_attention_layernorm
        gate, up = self._lin(_rms(h, ln2.weight, ln2.eps), gate_up_w).chunk(2, dim=-1)
        return h + self._lin(F.silu(gate) * up, down_w)
