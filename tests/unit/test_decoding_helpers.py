"""Micro model builders shared by the decoding tests."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def micro_llama(
    hidden: int,
    layers: int,
    vocab: int,
    seed: int,
    scale: float = 8.0,
    attention_gain: tuple[float, float] | None = None,
    **config,
) -> LlamaForCausalLM:
    """A random Llama; embedding and lm_head are scaled (NOTES.md) so greedy outputs vary instead of repeating.
    attention_gain (qk, vo): scale the query/key and value/output projections, so that attention is peaked and
    its output counts. A random model's attention is nearly uniform: a position id off by one moves its next-token
    distribution by ~1e-4 in total variation, ~0.15 with (8, 4), which tests of positions need.
    `config` overrides LlamaConfig fields (heads, special token ids, ...)."""
    torch.manual_seed(seed)
    fields = dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    fields.update(config)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, **fields
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(scale)
        model.lm_head.weight.mul_(scale)
        for layer in model.model.layers if attention_gain else ():
            attn = layer.self_attn
            for proj, gain in ((attn.q_proj, attention_gain[0]), (attn.k_proj, attention_gain[0])):
                proj.weight.mul_(gain)
            for proj, gain in ((attn.v_proj, attention_gain[1]), (attn.o_proj, attention_gain[1])):
                proj.weight.mul_(gain)
    return model


def micro_arch(arch: str, hidden: int, vocab: int, seed: int, **config):
    """A random `arch` (Qwen2, Qwen3, Mistral, ...) causal LM, 2 layers, sliding window off, embedding and head
    scaled by 8 like micro_llama's. `config` overrides config fields."""
    import transformers

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
        eos_token_id=None,
    )
    fields.update(config)
    model = getattr(transformers, f"{arch}ForCausalLM")(
        getattr(transformers, f"{arch}Config")(**fields)
    ).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8)
        model.get_output_embeddings().weight.mul_(8)
    return model


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with `model` often but not always: its weights plus `noise` * std Gaussian noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(noise * w.std() * torch.randn(w.shape, generator=gen))
    return draft


@contextlib.contextmanager
def single_thread():
    """Micro models are latency bound: one thread avoids oversubscribing the shared 2 cores (10x faster here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_module():
    """single_thread() for a whole test module: import it into the module (an autouse fixture)."""
    with single_thread():
        yield


def mixed_batch_joint_counts(bs, prompt, vocab: int, num: int, seed: int, settings: dict) -> torch.Tensor:
    """Counts [vocab**3] of the 3 tokens after `prompt` over `num` rows decoded by the batched decoder `bs` in
    batches of 10 observed rows (row i seeded seed + i, sampled with `settings`) plus a greedy and a cooler
    neighbour with other prompts and lengths: the mixed-batch joint-law tests' loop (test_batch_decoding with a
    draft, test_head with a head)."""
    counts = torch.zeros(vocab**3, dtype=torch.long)
    for start in range(0, num, 10):
        rows = [
            bs.add(
                prompt,
                max_new_tokens=3,
                eos_token_id=[],
                generator=torch.Generator().manual_seed(seed + i),
                **settings,
            )
            for i in range(start, start + 10)
        ]
        bs.add([1, 2, 3, 4], max_new_tokens=5, temperature=0.0, eos_token_id=[])
        bs.add(
            [5, 6],
            max_new_tokens=4,
            temperature=0.5,
            eos_token_id=[],
            generator=torch.Generator().manual_seed(start),
        )
        while bs.rows:
            bs.step()
        for row in rows:
            a, b, c = row.generated
            counts[(a * vocab + b) * vocab + c] += 1
    return counts
