"""Small Llama-architecture models for the tiny world, and the byte-level BPE tokenizer they share."""

from __future__ import annotations

from collections.abc import Iterable

from resispec.models.config import SizeConfig

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


def make_llama(size: SizeConfig, vocab_size: int, max_position_embeddings: int, tokenizer=None):
    """A randomly initialised LlamaForCausalLM of the given size preset (tied embeddings, as small Llamas do).

    With a tokenizer, its bos/eos/pad ids go into the config so `generate` stops at eos."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = {}
    if tokenizer is not None:
        ids = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        intermediate_size=size.intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        **ids,
    )
    return LlamaForCausalLM(config)


def num_params(model) -> int:
    """Parameters counted once (tied embeddings are one tensor)."""
    return sum(p.numel() for p in model.parameters())


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE trained with `tokenizers`, wrapped as a PreTrainedTokenizerFast.

    Encoding prepends bos (as Llama tokenizers do); decoding with skip_special_tokens round-trips any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1 << 30
    )


def grow_depth(model, factor: int):
    """Block expansion: a Llama `factor` x deeper that computes the same function as `model`.

    New layer j copies trained layer j // factor; the copies' o_proj and down_proj start at zero, so each copy
    adds nothing to the residual stream until further training moves them (as in LLaMA Pro)."""
    import copy

    from transformers import LlamaForCausalLM

    if factor <= 1:
        return model
    config = copy.deepcopy(model.config)
    old_layers = config.num_hidden_layers
    config.num_hidden_layers = old_layers * factor
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [t for t in config.layer_types for _ in range(factor)]
    grown = LlamaForCausalLM(config)
    old_state = model.state_dict()
    new_state = {}
    for name, value in grown.state_dict().items():
        if not name.startswith("model.layers."):
            new_state[name] = old_state[name]
            continue
        idx, rest = name[len("model.layers.") :].split(".", 1)
        src = int(idx) // factor
        value = old_state[f"model.layers.{src}.{rest}"].clone()
        if int(idx) % factor and rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            value.zero_()
        new_state[name] = value
    grown.load_state_dict(new_state)
    grown.generation_config = copy.deepcopy(model.generation_config)
    return grown.to(next(model.parameters()).dtype)
