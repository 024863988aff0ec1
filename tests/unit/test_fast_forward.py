"""The decoder's own forward (resispec/decoding/fast_forward.py) against the HF forward it replaces: logits and
cache contents on every path the decoders use, for every supported architecture, and the fallbacks."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import transformers

import resispec.decoding.fast_forward as ff
from resispec.decoding import SpeculativeDecoder
from resispec.decoding.batch import BatchedDecoder
from resispec.decoding.fast_forward import FastCausalLM, fast_forward
from resispec.decoding.kv_cache import (
    batch_attention_mask,
    compact_to_path,
    crop_cache,
    forward_logits,
    new_cache,
    select_cache_rows,
    tree_attention_mask,
)
from tests.unit.test_decoding_helpers import micro_arch, micro_llama, one_thread_per_module  # noqa: F401 (autouse fixture)

VOCAB = 96
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.fixture(autouse=True)
def pack_every_linear(monkeypatch):
    """The micro models' weights are below ff._PACK_MIN_BYTES and ff._WXT_MIN_BYTES: here every float32 linear
    takes the oneDNN-packed path and every other CPU linear the W @ x^T one, so each test below holds those paths
    to HF's forward (elsewhere small weights take F.linear)."""
    monkeypatch.setattr(ff, "_PACK_MIN_BYTES", 0)
    monkeypatch.setattr(ff, "_WXT_MIN_BYTES", 0)


def test_cpu_linear_forms_equal_x_times_w_transposed(monkeypatch):
    """_linear's CPU forms (W @ x^T with one row fed twice and 13-15, 21-23 rows padded; F.linear for small
    weights or many rows) are the same product as x @ W^T + b at every row count and batch shape."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    for wxt_min in (0, 1 << 30):  # every weight on W @ x^T; none
        monkeypatch.setattr(ff, "_WXT_MIN_BYTES", wxt_min)
        for shape in [(1, 1, 32), (1, 2, 32), (1, 5, 32), (1, 13, 32), (1, 16, 32), (1, 22, 32), (3, 7, 32)]:
            x = torch.randn(*shape, generator=gen)
            for b in (bias, None):
                want = x @ weight.T + (0 if b is None else b)
                torch.testing.assert_close(ff._linear(x, weight, b, True), want, **TOL)


def _model(arch: str, seed: int = 0, **extra):
    if arch == "Llama":
        return micro_llama(64, 2, VOCAB, seed=seed, **extra)
    return micro_arch(arch, 64, VOCAB, seed, **extra)


def _same_caches(a, b) -> None:
    for la, lb in zip(a.layers, b.layers, strict=True):
        torch.testing.assert_close(la.keys, lb.keys, **TOL)
        torch.testing.assert_close(la.values, lb.values, **TOL)


@pytest.mark.parametrize("arch", ["Llama", "Mistral", "Qwen2", "Qwen3"])
@torch.inference_mode()
def test_logits_and_cache_equal_hf_on_every_decoder_path(arch):
    """Prefill (long: x @ W^T; short: W @ x^T), one token (the padded two-column product), a tree block under a 4D
    mask, several tokens with no mask after a cache (causal aligned to the cache's end), logits_to_keep; then the
    cache edits of the decoders (crop, compaction to a path) and more forwards on the edited caches."""
    model = _model(arch)
    fast = fast_forward(model)
    assert isinstance(fast, FastCausalLM) and fast_forward(model) is fast  # built once per model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 200), generator=gen)
    hf_cache, our_cache = new_cache(model), new_cache(model)

    def both(*args, **kwargs):
        want = forward_logits(model, *args[:1], hf_cache, *args[1:], **kwargs)
        got = forward_logits(fast, *args[:1], our_cache, *args[1:], **kwargs)
        torch.testing.assert_close(got, want, **TOL)
        _same_caches(our_cache, hf_cache)
        return got

    both(ids[:, :150])  # > 128 rows: x @ W^T
    both(ids[:, 150:160], logits_to_keep=1)  # no mask after a cache: causal from the cache's end
    both(ids[:, 160:161])  # one token
    # a [2, 1] tree after the 161 cached tokens: root, two children of the root, one grandchild under the second
    block = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    pos = torch.tensor([[161, 162, 162, 163]])
    both(ids[:, 161:165], pos, tree_attention_mask(161, block, model.dtype))
    for cache in (hf_cache, our_cache):
        compact_to_path(cache, 161, [0, 2, 3])  # keep root, second child, grandchild
    both(ids[:, 165:167])
    for cache in (hf_cache, our_cache):
        crop_cache(cache, 120)  # the next append writes over the cropped tokens
    both(ids[:, 120:125])
    both(ids[:, 125:126])


@torch.inference_mode()
def test_ragged_batch_with_row_removal_equals_hf():
    """The batched decoders' layout: right-aligned rows of different lengths under the batch mask, per-row positions,
    a row leaving (after the HF forward a plain tensor, index_select; after ours a row moved inside the buffer)."""
    model = _model("Llama", seed=3)
    fast = fast_forward(model)
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([7, 12, 9])
    ids = torch.randint(0, VOCAB, (3, 12), generator=gen)
    hf_cache, our_cache = new_cache(model), new_cache(model)
    mask = batch_attention_mask(torch.zeros(3, dtype=torch.long), 0, 12, model.dtype)
    cols = torch.arange(12)
    own = cols[None, :] >= (12 - lengths)[:, None]  # right-aligned: row b's tokens are its last lengths[b]
    mask = mask.masked_fill(~own[:, None, None, :], torch.finfo(model.dtype).min)
    pos = (cols[None, :] - (12 - lengths)[:, None]).clamp(min=0)
    for fwd, cache in ((model, hf_cache), (fast, our_cache)):
        forward_logits(fwd, ids, cache, pos, mask)
    _same_caches(our_cache, hf_cache)
    step = torch.randint(0, VOCAB, (3, 5), generator=gen)  # 15 rows: padded to 16 (fast_forward._linear)
    step_mask = batch_attention_mask(lengths, 12, 5, model.dtype)
    step_pos = lengths[:, None] + torch.arange(5)[None]
    want = forward_logits(model, step, hf_cache, step_pos, step_mask)
    got = forward_logits(fast, step, our_cache, step_pos, step_mask)
    torch.testing.assert_close(got[own[:, -1]], want[own[:, -1]], **TOL)
    _same_caches(our_cache, hf_cache)
    keep = torch.tensor([2, 0])
    for cache in (hf_cache, our_cache):
        select_cache_rows(cache, keep)
    lengths = lengths[keep] + 5
    one = torch.randint(0, VOCAB, (2, 1), generator=gen)
    args = (lengths[:, None], batch_attention_mask(lengths, 17, 1, model.dtype))
    torch.testing.assert_close(
        forward_logits(fast, one, our_cache, *args), forward_logits(model, one, hf_cache, *args), **TOL
    )
    _same_caches(our_cache, hf_cache)


@pytest.mark.parametrize("arch", ["Llama", "Qwen2"])
def test_weights_changed_after_the_forward_was_built_are_used(arch):
    """On CPU the fast forward multiplies by COPIES: fused q/k/v and gate/up, and in float32 every linear's weight
    packed for oneDNN (o, down and the tied head too). Weights edited in place (an optimizer step) or replaced
    (.to(dtype)) after it was built must still be the ones it uses (Qwen2: the q/k/v biases)."""
    model = _model(arch, seed=5)
    fast = fast_forward(model)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))

    def same():
        with torch.inference_mode():
            want = forward_logits(model, ids, new_cache(model))
            got = forward_logits(fast, ids, new_cache(model))
        torch.testing.assert_close(got, want, **TOL)

    same()
    attn, mlp = model.model.layers[-1].self_attn, model.model.layers[0].mlp
    with torch.no_grad():
        attn.k_proj.weight.mul_(-2.0)  # in place
        mlp.up_proj.weight.add_(0.05)
        if attn.v_proj.bias is not None:
            attn.v_proj.bias.add_(1.0)
    same()
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.mul_(0.5)
        mlp.down_proj.weight.add_(0.02)
        model.lm_head.weight.mul_(1.5)  # tied to the embedding
    same()
    model.to(torch.float64)  # every parameter replaced
    same()


def test_float32_cpu_linears_use_onednn_packed_weights():
    """Float32 on CPU: every linear multiplies by a oneDNN-packed copy of its weight (the same product as
    x @ W^T + b at every row count and batch shape); float64 keeps the plain weights."""
    if not ff._can_pack(torch.float32):
        pytest.skip("this torch build has no oneDNN linear")
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    packed = ff._pack(weight)
    for shape in [(1, 1, 32), (1, 2, 32), (1, 5, 32), (3, 7, 32), (1, 25, 32)]:
        x = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(ff._linear(x, weight, bias, True, packed), x @ weight.T + bias, **TOL)
    model = _model("Llama")
    fast = fast_forward(model)
    assert len(fast._packed) == len(model.model.layers) and fast._packed_head is not None
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        want = forward_logits(fast, ids, new_cache(model))
        # a deep copy or a pickle of the model carries its forward without the packed copies, rebuilt on use
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            torch.testing.assert_close(forward_logits(fast_forward(other), ids, new_cache(other)), want)
            assert fast_forward(other) is not fast and fast_forward(other)._packed
        model.to(torch.float64)
        forward_logits(fast, ids, new_cache(model))
    assert fast._packed == [] and fast._packed_head is None and fast._fused  # rebuilt as plain fused copies


def test_fused_but_not_packed_when_every_linear_would_not_fit(monkeypatch):
    """The copies' budget: q/k/v and gate/up fused while they fit in ff.FUSE_MAX_BYTES, packed copies of every linear
    only while all of them (o, down and the head too) fit as well."""
    model = _model("Llama")
    layers = model.model.layers
    fused = sum(
        m.weight.numel() * 4
        for layer in layers
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
        + (layer.mlp.gate_proj, layer.mlp.up_proj)
    )
    monkeypatch.setattr(ff, "FUSE_MAX_BYTES", fused)
    fast = FastCausalLM(model)
    assert fast.fuse and fast._fused and not fast.pack and fast._packed == [] and fast._packed_head is None
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.inference_mode():
        torch.testing.assert_close(
            forward_logits(fast, ids, new_cache(model)), forward_logits(model, ids, new_cache(model)), **TOL
        )


def _head_path(m, cache, feats, ids) -> tuple:
    """A head's decoding path (m: the head or its fast forward): a prompt's pairs (causal), one more pair after
    them, a level of 3 tree nodes under a mask (node 1 does not see node 0)."""
    h0 = m.step(m.fuse(feats[:, :5]), ids[:, :5], torch.arange(5)[None], cache)
    h1 = m.step(m.fuse(feats[:, 5:]), ids[:, 5:], torch.tensor([[5]]), cache)
    mask = torch.zeros(1, 1, 3, 9)
    mask[0, 0, 1, 6] = float("-inf")
    level = m.step(h1.expand(1, 3, -1).contiguous(), ids[:, :3], torch.full((1, 3), 6), cache, mask)
    return h0, h1, level, m.target_logits(level), m.logits(h0)


def test_a_draft_heads_fast_forward_equals_the_heads_own_step():
    """A draft head's fast forward (FastHead: packed / W @ x^T linears here, fused q/k/v and gate/up, K/V appended
    in place) gives the head's own fuse, step and logits on every decoding path (`_head_path`), with GQA (the micro
    target's 4 heads over 2) and with a reduced vocabulary; and it uses weights changed after it was built (a
    training step)."""
    from resispec.models.head import DraftHead

    target = micro_llama(64, 4, VOCAB, seed=1, attention_gain=(8.0, 4.0))
    gen = torch.Generator().manual_seed(3)
    feats, ids = torch.randn(1, 6, 2 * 64, generator=gen), torch.randint(0, VOCAB, (1, 6), generator=gen)
    for vocab in (None, 40):
        counts = torch.arange(VOCAB, dtype=torch.float64) if vocab else None
        head = DraftHead.from_target(
            target, layers=[1, 3], draft_vocab_size=vocab, token_counts=counts, seed=2
        )
        fast = fast_forward(head)
        assert isinstance(fast, ff.FastHead) and fast_forward(head) is fast and fast.layers == head.layers
        for edit in range(2):
            if edit:  # a training step after the forward was built (in place: the versions move)
                with torch.no_grad():
                    head.midlayer.self_attn.k_proj.weight.mul_(-2.0)
                    head.lm_head.weight.add_(0.1)
                    head.fc.weight.mul_(0.5)
            caches = new_cache(head), new_cache(head)
            with torch.inference_mode():
                got = _head_path(fast, caches[0], feats, ids)
                want = _head_path(head, caches[1], feats, ids)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, **TOL)
            _same_caches(*caches)


def test_unsupported_models_run_the_hf_forward():
    gelu = micro_llama(32, 1, VOCAB, seed=0, hidden_act="gelu")
    assert fast_forward(gelu) is gelu and fast_forward(gelu) is gelu
    assert gelu not in list(gelu.children())  # the cached answer is not registered as a submodule
    assert (
        gelu.state_dict().keys() == micro_llama(32, 1, VOCAB, seed=0, hidden_act="gelu").state_dict().keys()
    )
    gelu.to(torch.float64)  # .to() walks the children: no recursion
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)
    )
    assert fast_forward(gpt2) is gpt2
    with pytest.raises(ValueError, match="no fast forward"):
        FastCausalLM(gelu)
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(
        micro_llama(32, 1, VOCAB, seed=1), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    assert fast_forward(lora) is lora  # the wrapper
    inner = lora.base_model.model
    assert fast_forward(inner) is inner  # the LoRA-injected model: its q/v deltas live outside .weight


@torch.inference_mode()
def test_decoders_on_either_forward_give_target_greedy():
    """Greedy decoding on the fast forward and on the HF forward both give HF generate's tokens; so does the batched
    AR decoder (which builds the fast forward itself)."""
    target, draft = micro_llama(64, 2, VOCAB, seed=0), micro_llama(32, 1, VOCAB, seed=1)
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    hf = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    for fast in (True, False):
        dec = SpeculativeDecoder(target, draft, rule="resispec", tree=[3, 2, 1], fast_forward=fast)
        assert isinstance(dec._target_fwd, FastCausalLM) is fast
        assert torch.equal(dec.generate(ids, max_new_tokens=16, temperature=0.0).sequences, hf)
        assert torch.equal(dec.generate_autoregressive(ids, max_new_tokens=16, temperature=0.0).sequences, hf)
    batched = BatchedDecoder(target)
    assert isinstance(batched._target_fwd, FastCausalLM)
    row = batched.add(ids[0], max_new_tokens=16, temperature=0.0)
    while batched.rows:
        batched.step()
    assert row.generated == hf[0, 5:].tolist()


@torch.inference_mode()
def test_cache_edits_in_the_buffer_equal_plain_tensor_edits():
    """Every batched cache edit on a layer held in its spare-room buffer (kv_cache.append_kv) gives the tensors the
    plain edits give (pad, cat, index_select, slice, gather), and the ones that fit do it without a new buffer:
    a row joining into a spare row, a row leaving, padding trimmed, appends after all of them."""
    from resispec.decoding.kv_cache import (
        _in_buffer,
        append_kv,
        gather_cache_columns,
        merge_cache_row,
        trim_cache_left,
    )

    model = _model("Llama")
    gen = torch.Generator().manual_seed(5)
    heads, dim = 2, 32

    def kv(b, t):
        return torch.randn(b, heads, t, dim, generator=gen)

    def pad_left(t, n):
        return torch.cat([t.new_zeros(*t.shape[:-2], n, t.shape[-1]), t], -2)

    def prefilled(t):  # a batch-1 row cache, as BatchedDecoder.add's prefill leaves it
        c = new_cache(model)
        if t:
            for layer in c.layers:
                layer.lazy_initialization(kv(1, 1), kv(1, 1))
                append_kv(layer, "keys", kv(1, t))
                append_kv(layer, "values", kv(1, t))
        return c

    cache = new_cache(model)
    ref = [[None, None] for _ in cache.layers]  # the plain tensors the edits should give

    def buffers():
        return [layer._resispec_keys.data_ptr() for layer in cache.layers]

    def check(*, same_buffer_as=None):
        for layer, (k, v) in zip(cache.layers, ref, strict=True):
            torch.testing.assert_close(layer.keys, k, rtol=0, atol=0)
            torch.testing.assert_close(layer.values, v, rtol=0, atol=0)
            assert _in_buffer(layer, "keys") is not None
        if same_buffer_as is not None:
            assert buffers() == same_buffer_as

    def join(t):
        row = prefilled(t)
        n = 0 if ref[0][0] is None else ref[0][0].shape[0]
        merge_cache_row(cache, n, row)
        for i, (layer_ref, layer) in enumerate(zip(ref, row.layers, strict=True)):
            for j, name in enumerate(("keys", "values")):
                r = getattr(layer, name) if t else None
                b = layer_ref[j]
                if b is None:
                    b = torch.zeros(n, heads, 0, dim)
                width = max(b.shape[-2], t)
                r = torch.zeros(1, heads, width, dim) if r is None else pad_left(r, width - t)
                ref[i][j] = torch.cat([pad_left(b, width - b.shape[-2]), r])

    def step(q):
        for layer, layer_ref in zip(cache.layers, ref, strict=True):
            for j, name in enumerate(("keys", "values")):
                new = kv(layer_ref[j].shape[0], q)
                append_kv(layer, name, new)
                layer_ref[j] = torch.cat([layer_ref[j], new], -2)

    def leave(rows):
        select_cache_rows(cache, torch.tensor(rows))
        for layer_ref in ref:
            layer_ref[:] = [t[rows] for t in layer_ref]

    join(0)  # a draft row before its first step: no tokens yet, no buffer yet
    join(9)
    step(1)
    join(5)
    first = buffers()
    join(0)  # a spare row: no new buffer
    check(same_buffer_as=first)
    step(2)
    leave([3, 1, 2])  # row 0 leaves, row 3 takes its slot: one row moves
    check(same_buffer_as=first)
    trim_cache_left(cache, 2)  # columns that hold row 1's first tokens (a holey cache trims stale nodes too)
    for layer_ref in ref:
        layer_ref[:] = [t[..., 2:, :] for t in layer_ref]
    step(1)  # the trimmed view still appends in place
    check(same_buffer_as=first)
    join(ref[0][0].shape[-2] + 1)  # one column longer than every row: the trimmed column is reused as padding
    check(same_buffer_as=first)
    join(30)  # longer than every row: the existing rows get padding (a new buffer: no room on the left)
    step(1)
    check()
    index = torch.stack(
        [
            torch.randperm(ref[0][0].shape[-2], generator=gen)[:6].sort().values
            for _ in range(ref[0][0].shape[0])
        ]
    )
    gather_cache_columns(cache, index)
    for layer_ref in ref:
        layer_ref[:] = [t.gather(2, index[:, None, :, None].expand(-1, heads, -1, dim)) for t in layer_ref]
    packed = buffers()
    step(3)
    check(same_buffer_as=packed)
    leave([3, 1])
    step(1)
    check(same_buffer_as=packed)
