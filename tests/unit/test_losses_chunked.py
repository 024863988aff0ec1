"""The chunked loss (issue 41) gives today's numbers and gradients: every shipped loss config, dense and top-K
targets, served top-p, chunk sizes that split the batch unevenly, logits given as such or as hidden states x the
LM head (the draft's head differentiated too), and the model-side row selection (micro Llama, LoRA-wrapped)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from resispec.decoding.config import DecodeConfig
from resispec.losses import (
    LOSSES,
    BatchConstants,
    Rows,
    TargetSignal,
    distill_loss,
    distill_loss_rows,
    fkl,
    loss_weights,
    model_rows,
    paired_logprobs,
    response_index,
)
from resispec.training.config import LossConfig

LOSS_CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("conf", "loss").glob("*.yaml"))


def reference_loss(draft_logits, target, loss_mask, loss, decode):
    """distill_loss as it was before issue 41: every response position in one [N, V] block, the batch-wide
    constants (draws=reach's mean alpha, fkl_residual's mean weight) computed from that block."""
    sel = loss_mask.bool()
    q_logits = draft_logits[sel]
    tgt = TargetSignal(target.values[sel], None if target.ids is None else target.ids[sel])
    w = loss_weights(loss_mask, loss, decode)[sel]
    full = paired_logprobs(tgt, q_logits, decode, truncate=False)
    truncates = loss.name in ("residual", "lk", "fkl_residual") and (decode.top_k > 0 or decode.top_p < 1.0)
    served = paired_logprobs(tgt, q_logits, decode, truncate=True) if truncates else full
    per_pos = LOSSES[loss.name](full, served, loss, decode, BatchConstants())
    return (per_pos * w).sum() / w.sum().clamp_min(1e-12), fkl(*full).detach().mean().item()


def _case(seed=0, b=3, t=9, v=37, k=None):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, t, v, generator=g) * 2).requires_grad_()
    p = torch.randn(b, t, v, generator=g) * 2
    mask = torch.zeros(b, t, dtype=torch.long)
    mask[0, 2:8], mask[1, 4:9], mask[2, 1:3] = 1, 1, 1  # 13 positions, three uneven runs
    if k is None:
        return q, TargetSignal(p), mask
    top = p.log_softmax(-1).topk(k, dim=-1)
    return q, TargetSignal(top.values, top.indices), mask


def _loss_cfg(path: Path, chunk: int) -> LossConfig:
    return LossConfig(**yaml.safe_load(path.read_text()), chunk_size=chunk)


@pytest.mark.parametrize("path", LOSS_CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk"])
def test_every_loss_matches_todays_value_and_gradient(path, sparse):
    decode = DecodeConfig(tree=[4, 2, 1, 1], top_p=0.9, temperature=0.8)
    q, target, mask = _case(k=8 if sparse else None)
    want, want_fkl = reference_loss(q, target, mask, _loss_cfg(path, 0), decode)
    (want_grad,) = torch.autograd.grad(want, q)
    cfg = _loss_cfg(path, 0)
    # the acceptance losses solve per row (slow on CPU): one uneven split (4 + 4 + 4 + 1) is enough there
    for chunk in (4,) if cfg.name in ("residual", "fkl_residual") else (1, 4, 0):
        got, stats = distill_loss(q, target, mask, _loss_cfg(path, chunk), decode)
        (grad,) = torch.autograd.grad(got, q)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-7)
        assert stats["num_positions"] == 13
        assert stats["fkl"] == pytest.approx(want_fkl, rel=1e-5)


@pytest.mark.parametrize("name", ["fkl", "residual", "fkl_residual"])
def test_head_rows_match_the_logits_path_gradients_included(name):
    """Rows(hidden, weight, bias): the head applied chunk by chunk, gradients of hidden, weight and bias as
    autograd gives them through F.linear over every row at once."""
    g = torch.Generator().manual_seed(3)
    n, h, v = 11, 6, 29
    x = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    bias = torch.randn(v, generator=g).requires_grad_()
    target = TargetSignal(Rows(torch.randn(n, h + 2, generator=g), torch.randn(v, h + 2, generator=g)))
    w = torch.rand(n, generator=g) + 0.5
    decode = DecodeConfig(tree=[2, 1], top_p=0.8)
    ref_target = TargetSignal(target.values.logits(slice(None)))
    want, _ = distill_loss_rows(
        Rows(F.linear(x, weight, bias)), ref_target, w, LossConfig(name, chunk_size=0), decode
    )
    want_grads = torch.autograd.grad(want, (x, weight, bias))
    got, _ = distill_loss_rows(Rows(x, weight, bias), target, w, LossConfig(name, chunk_size=4), decode)
    grads = torch.autograd.grad(got, (x, weight, bias))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_no_grad_and_empty_batches():
    q, target, mask = _case()
    with torch.no_grad():
        value, stats = distill_loss(q, target, mask, LossConfig("fkl", chunk_size=4), DecodeConfig())
    assert not value.requires_grad and stats["num_positions"] == 13
    value, stats = distill_loss(q, target, mask * 0, LossConfig("fkl"), DecodeConfig())
    value.backward()  # a zero that keeps the graph
    assert stats["num_positions"] == 0 and float(value.detach()) == 0.0


def _micro_llama(vocab=41, hidden=16, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).float()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_model_rows_fused_and_logits_paths_match_the_full_forward(lora):
    """model_rows: hidden states + head (fused) or the rows' logits (the sharded path) equal the full forward's
    logits at the response positions, and the loss's gradients reach the same parameters with the same values."""
    model = _micro_llama()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        )
        torch.nn.init.normal_(model.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight)
    target = _micro_llama(seed=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 41, (2, 10), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    mask = torch.zeros(2, 9, dtype=torch.long)
    mask[0, 3:9], mask[1, 5:8] = 1, 1
    index = response_index(mask, 10)
    cfg, decode = (
        LossConfig("lk", form="lambda", chunk_size=2),
        DecodeConfig(tree=[2, 1]),
    )  # smooth: no solver branch
    params = [p for p in model.parameters() if p.requires_grad]

    full_logits = model(**batch).logits[:, :-1]
    with torch.no_grad():
        t_logits = target(**batch).logits[:, :-1]
    want, _ = distill_loss(full_logits, TargetSignal(t_logits), mask, cfg, decode)
    want_grads = torch.autograd.grad(want, params)
    w = loss_weights(mask, cfg, decode)[mask.bool()]
    for fused in (True, False):
        rows = model_rows(model, model, batch, index, fused)
        assert (rows.weight is not None) == fused
        with torch.no_grad():
            t_rows = model_rows(target, target, batch, index, fused)
        torch.testing.assert_close(rows.logits(slice(None)), full_logits[mask.bool()], rtol=1e-5, atol=1e-5)
        got, _ = distill_loss_rows(rows, TargetSignal(t_rows), w, cfg, decode)
        grads = torch.autograd.grad(got, params)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # the head is back in place


def test_trim_padding_cuts_the_batch_to_its_longest_row():
    from resispec.data.packing import trim_padding

    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    batch = {
        "input_ids": torch.arange(12).view(2, 6),
        "attention_mask": mask,
        "topk_ids": torch.zeros(2, 6, 3),
    }
    out = trim_padding(batch)
    assert out["input_ids"].shape == (2, 4) and out["topk_ids"].shape == (2, 4, 3)
    assert torch.equal(out["input_ids"], batch["input_ids"][:, :4])
    full = {k: v[:, :4] for k, v in batch.items()}
    full["attention_mask"] = torch.ones(2, 4, dtype=torch.long)
    assert trim_padding(full) is full  # nothing to cut
