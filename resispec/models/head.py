"""An EAGLE-3-style draft head (`draft.kind=head`): a drafter that reads the target's own hidden states.

Architecture (reference: shared/EAGLE3_NOTES.md section 1, EAGLE's `cnets.py`): the residual-stream states entering
target layers `layers` (default low / middle / high: 2, L//2, L-3, as EAGLE-3; HF `hidden_states[k]`, vLLM's aux id k)
are concatenated and fused by `fc` (k*H -> H, no bias); ONE decoder layer of the target's width (its GQA and rope)
whose attention input is [input_layernorm(embedding of the token), hidden_norm(g)] (2H wide), residual := g; its own
`norm` and `lm_head` (H -> N, N = the draft vocabulary, reduced or the target's), `d2t` (draft id -> target id
offset) and `t2d` (target-id membership); the target's embedding is reused frozen (not a parameter of the head).

Alignment (training and decoding agree): the head's entry at position i reads (the target's features at i, the
embedding of token i+1) and predicts token i+2. Below the first level (training-time test step j >= 1, tree depth
j >= 1) the entry at i+j reads (the head's own pre-norm output of step j-1 at i, the embedding of token i+1+j).

Saved as a folder: config.json (a Llama config with `num_hidden_layers: 1`, `draft_vocab_size`,
`eagle_aux_hidden_state_layer_ids`, `target_hidden_size`, `resispec_head: true`) and model.safetensors with EAGLE's
key names (fc, midlayer.*, norm, lm_head, d2t, t2d): the vLLM `eagle3` export is a copy of it
(resispec/models/head_export.py).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from resispec.errors import UserError

HEAD_WEIGHTS = "model.safetensors"


class HeadConfigError(UserError, ValueError):
    """A head setting that does not fit the target (layer ids, vocabulary)."""


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's (2, L//2, L-3) (e.g. 2, 6, 9 for L = 12), clipped to [0, L-1] and de-duplicated as vLLM does
    (a shallow target gets fewer: [0, 1] for L = 2)."""
    return sorted({max(0, min(num_layers - 1, i)) for i in (2, num_layers // 2, num_layers - 3)})


def is_head(model) -> bool:
    return isinstance(model, DraftHead)


def is_head_dir(path: str | Path) -> bool:
    """A folder written by `DraftHead.save_pretrained`."""
    cfg = Path(path) / "config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("resispec_head"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama RMSNorm: normalise in float32, cast back, scale (one fused op when the model is float32); the
    decoder's fast forward uses it too."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * torch.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        h, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, m, bias=False)
        self.up_proj = nn.Linear(h, m, bias=False)
        self.down_proj = nn.Linear(m, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = _Norm(cfg.hidden_size, eps)
        self.hidden_norm = _Norm(cfg.hidden_size, eps)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, eps)
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)


def head_config(
    target_config, layers: list[int] | None, draft_vocab_size: int | None, intermediate_size=None
):
    """The head's config: the target's (width, heads, GQA, rope, eps, vocabulary) with one layer and the head's
    fields. Layer ids must be inputs of target layers (0..L-1): HF's hidden_states[L] is post-norm, vLLM's id L is
    not, so the last one is refused."""
    num_layers = target_config.num_hidden_layers
    layers = default_layers(num_layers) if not layers else [int(i) for i in layers]
    if any(i < 0 or i >= num_layers for i in layers):
        raise HeadConfigError(
            f"draft.head.layers={layers}: ids must be in 0..{num_layers - 1} (the target has {num_layers} layers)"
        )
    vocab = target_config.vocab_size
    n = int(draft_vocab_size) if draft_vocab_size else vocab
    if not 0 < n <= vocab:
        raise HeadConfigError(
            f"draft.head.draft_vocab_size={n} must be in 1..{vocab} (the target's vocabulary)"
        )
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = 1
    if intermediate_size:
        cfg.intermediate_size = int(intermediate_size)
    cfg.draft_vocab_size = n
    cfg.target_hidden_size = target_config.hidden_size
    cfg.eagle_aux_hidden_state_layer_ids = layers
    cfg.resispec_head = True
    cfg.tie_word_embeddings = False
    if getattr(cfg, "head_dim", None) is None:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[:1]
    if getattr(cfg, "sliding_window", None) is not None:
        cfg.sliding_window = None
    cfg._attn_implementation = "sdpa"
    return cfg


class DraftHead(nn.Module):
    """The head (module docstring). Built from a target with `from_target`, loaded with `from_pretrained(path,
    target)`; either way `attach_target` gives it the target's frozen embedding (and, for the causal-LM view used by
    the held-out evaluation, the target itself)."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = config
        h, n = config.hidden_size, config.draft_vocab_size
        self.layers = list(config.eagle_aux_hidden_state_layer_ids)
        self.fc = nn.Linear(len(self.layers) * config.target_hidden_size, h, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = _Norm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, n, bias=False)
        vocab = config.vocab_size
        self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))
        self.register_buffer(
            "t2d", torch.ones(vocab, dtype=torch.bool) if n == vocab else torch.zeros(vocab, dtype=torch.bool)
        )
        self.rotary = LlamaRotaryEmbedding(config)
        self.num_heads, self.num_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self._embed: torch.Tensor | None = None
        self._target = None

    # ------------------------------------------------------------------ construction, saving, loading
    @classmethod
    def from_target(
        cls, target, layers=None, draft_vocab_size=None, intermediate_size=None, token_counts=None, seed=0
    ):
        """A fresh head for `target`: lm_head rows and the final norm copied from the target's (trainable), the rest
        initialised as HF initialises a Llama layer. A reduced vocabulary keeps the `draft_vocab_size` most frequent
        tokens of `token_counts` [V] (EAGLE-3's choice), sorted by id."""
        cfg = head_config(target.config, layers, draft_vocab_size, intermediate_size)
        gen = torch.Generator().manual_seed(seed)
        head = cls(cfg)
        std = getattr(cfg, "initializer_range", 0.02)
        with torch.no_grad():
            for mod in head.modules():
                if isinstance(mod, nn.Linear):
                    mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * std)
            ids = head.draft_ids_for(token_counts)
            head.set_vocab(ids)
            tgt_head = target.get_output_embeddings().weight
            head.lm_head.weight.copy_(tgt_head.detach()[ids.to(tgt_head.device)].to(head.lm_head.weight))
            head.norm.weight.copy_(target.model.norm.weight.detach().to(head.norm.weight))
        head.to(device=next(target.parameters()).device, dtype=target.dtype)
        head.attach_target(target)
        return head

    def draft_ids_for(self, token_counts) -> torch.Tensor:
        vocab, n = self.config.vocab_size, self.config.draft_vocab_size
        if n == vocab:
            return torch.arange(vocab)
        if token_counts is None:
            raise HeadConfigError("a reduced draft vocabulary needs token counts of the training data")
        counts = torch.as_tensor(token_counts, dtype=torch.float64)
        top = torch.topk(counts + torch.arange(vocab, dtype=torch.float64) * -1e-9, n).indices
        return top.sort().values

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """d2t / t2d from the sorted target ids of the draft vocabulary."""
        draft_ids = draft_ids.to(self.d2t.device)
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel(), device=draft_ids.device))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[N] the target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    @property
    def reduced(self) -> bool:
        return self.config.draft_vocab_size != self.config.vocab_size

    def attach_target(self, target) -> DraftHead:
        """Reuse the target's embedding (frozen) and keep the target for `__call__`'s causal view; neither becomes
        a submodule (state_dict, parameters and .to() are the head's own)."""
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_embed", target.get_input_embeddings().weight)
        return self

    def save_pretrained(
        self, out_dir, state_dict: dict | None = None, safe_serialization: bool = True, **_
    ) -> None:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = self.state_dict() if state_dict is None else state_dict
        state = {k: v.detach().contiguous().cpu() for k, v in state.items() if not k.startswith("rotary.")}
        save_file(state, str(out / HEAD_WEIGHTS), metadata={"format": "pt"})
        cfg = self.config.to_dict()
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
        cfg["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")

    @classmethod
    def from_pretrained(cls, path, target=None, device=None, dtype=None) -> DraftHead:
        from safetensors.torch import load_file
        from transformers import AutoConfig

        path = Path(path)
        cfg = AutoConfig.from_pretrained(path)
        cfg._attn_implementation = "sdpa"
        head = cls(cfg)
        state = load_file(str(path / HEAD_WEIGHTS))
        head.load_state_dict(state, strict=False)
        missing = [k for k in head.state_dict() if k not in state and not k.startswith("rotary.")]
        if missing:
            raise HeadConfigError(f"{path}: head weights missing {missing[:4]}")
        if target is not None:
            head.to(device=next(target.parameters()).device, dtype=target.dtype if dtype is None else dtype)
            if (
                target.config.hidden_size != cfg.target_hidden_size
                or target.config.vocab_size != cfg.vocab_size
            ):
                raise HeadConfigError(
                    f"{path}: the head was trained for a target of width {cfg.target_hidden_size} and vocabulary "
                    f"{cfg.vocab_size}; this target has {target.config.hidden_size} and {target.config.vocab_size}"
                )
            head.attach_target(target)
        elif device is not None or dtype is not None:
            head.to(device=device, dtype=dtype)
        return head.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # ------------------------------------------------------------------ the layer
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[.., k*H] target features -> [.., H]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def _qkv(self, hidden, ids, position_ids):
        layer = self.midlayer
        bsz, num_q = ids.shape
        e = F.embedding(ids, self._embed).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(hidden)], dim=-1)
        attn, d = layer.self_attn, self.head_dim
        q = attn.q_proj(x).view(bsz, num_q, self.num_heads, d).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, num_q, self.num_kv, d).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, num_q, self.num_kv, d).transpose(1, 2)
        cos, sin = self.rotary(x, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _finish(self, hidden, q, keys, values, mask, causal=False):
        a = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            is_causal=causal,
            scale=self.scaling,
            enable_gqa=self.num_kv != self.num_heads,
        )
        bsz, _, num_q, _ = q.shape
        h = hidden + self.midlayer.self_attn.o_proj(a.transpose(1, 2).reshape(bsz, num_q, -1))
        return h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))

    def step(self, hidden, ids, position_ids, cache=None, attention_mask=None) -> torch.Tensor:
        """One cached forward of the layer: hidden [B, Q, H] (fused target features or the head's own outputs),
        ids [B, Q], position_ids [B, Q], cache a one-layer DynamicCache (extended), attention_mask additive 4D over
        cache + new or None (causal) -> the pre-norm outputs [B, Q, H]."""
        q, k, v = self._qkv(hidden, ids, position_ids)
        past = 0 if cache is None else cache.get_seq_length()
        if cache is not None:
            k, v = cache.update(k, v, 0)
        causal = attention_mask is None and q.shape[2] > 1
        if causal and past:
            col = torch.arange(past + q.shape[2], device=q.device)
            attention_mask = (col[None] <= past + torch.arange(q.shape[2], device=q.device)[:, None])[
                None, None
            ]
            causal = False
        return self._finish(hidden, q, k, v, attention_mask, causal)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., N] of pre-norm outputs."""
        return self.lm_head(self.norm(h))

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [.., V] of pre-norm outputs (`to_target_vocab`)."""
        return self.to_target_vocab(self.logits(h))

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., N] -> the target's vocabulary [.., V]: a reduced vocabulary's other tokens
        get the dtype's min (probability 0 after softmax)."""
        if not self.reduced:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), torch.finfo(logits.dtype).min)
        return full.index_copy_(-1, self.draft_to_target, logits)

    def ttt(self, features: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: the unroll of `steps` steps over whole rows -> pre-norm outputs [B, T, H] per step.
        Step 0 reads fc(features) at index i with token i+1; step j reads step j-1's output at i with token i+1+j
        (teacher forcing) at position i+j; its query sees step 0's keys at indices <= i and steps 1..j's keys at i
        only (a tree path's ancestors), as in decoding. Tokens past the row are 0 (their rows carry no loss)."""
        bsz, seq = input_ids.shape
        dev = input_ids.device
        hidden = self.fuse(features)
        idx = torch.arange(seq, device=dev)
        causal = idx[None, :] <= idx[:, None]  # [T, T]
        diag = torch.eye(seq, dtype=torch.bool, device=dev)
        keys, values, outs = [], [], []
        for j in range(steps):
            ids = F.pad(input_ids[:, 1 + j :], (0, 1 + j))
            pos = (idx + j)[None].expand(bsz, -1)
            q, k, v = self._qkv(hidden, ids, pos)
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [diag] * j, dim=1)[None, None]  # [1, 1, T, (j+1)T]
            hidden = self._finish(hidden, q, torch.cat(keys, 2), torch.cat(values, 2), mask)
            outs.append(hidden)
        return outs

    # ------------------------------------------------------------------ a causal-LM view (held-out evaluation)
    def forward(self, input_ids: torch.Tensor, attention_mask=None, features=None, ttt_steps: int = 1, **_):
        """With `features` (training, through the wrapped module): `ttt(features, input_ids, ttt_steps)`.
        Else logits [B, T, V] as a causal LM's (row t predicts token t+1): the head's step-0 output at t-1 over the
        target's features (row 0, which the head cannot predict, is the target's own). Needs `attach_target`."""
        from types import SimpleNamespace

        if features is not None:
            return self.ttt(features, input_ids, ttt_steps)

        target = self._target
        if target is None:
            raise HeadConfigError("the head's causal view needs the target (attach_target)")
        with torch.no_grad():
            out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            feats = torch.cat([out.hidden_states[i] for i in self.layers], dim=-1)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        ids = F.pad(input_ids[:, 1:], (0, 1))
        h = self.step(self.fuse(feats), ids, pos)
        logits = self.target_logits(h)[:, :-1].to(out.logits.dtype)
        return SimpleNamespace(logits=torch.cat([out.logits[:, :1], logits], dim=1))
