"""Load the model pair, build the decoder and run the app with uvicorn (what `serve/server.py` calls)."""

from __future__ import annotations

import logging

from resispec.decoding import SpeculativeDecoder
from resispec.decoding.config import DecodeConfig
from resispec.models import load_pair
from resispec.models.config import ModelConfig, WorldConfig
from resispec.serving.app import create_app
from resispec.serving.config import ServerConfig
from resispec.serving.worker import DecoderEngine
from resispec.verify import build_rule

log = logging.getLogger(__name__)

# `decode.rule` values that serve the target alone (plain autoregressive decoding, the baseline)
AR_RULES = ("ar", "none")


def context_length(target, draft, server: ServerConfig) -> int:
    """The server's context length: `server.max_model_len`, else the smaller max_position_embeddings."""
    if server.max_model_len is not None:
        return server.max_model_len
    lengths = [getattr(m.config, "max_position_embeddings", None) for m in (target, draft)]
    lengths = [n for n in lengths if n]
    return min(lengths) if lengths else 2048


def build_engine(target, draft, tokenizer, decode: DecodeConfig, server: ServerConfig | None = None):
    """A DecoderEngine for the loaded pair under the `decode` settings (rule `ar` serves the target alone);
    `server` sets continuous batching (max_batch_size, kv_budget_tokens, speculation)."""

    speculative = decode.rule not in AR_RULES
    decoder = SpeculativeDecoder(
        target,
        draft,
        rule=build_rule(decode.rule, decode.auto_policy)
        if speculative
        else "chain",  # AR never calls the rule
        tree=decode.tree,
        tokenizer=tokenizer,
        compile=decode.compile,
    )
    server = server or ServerConfig(max_batch_size=1)
    return DecoderEngine(
        decoder,
        tokenizer,
        speculative=speculative,
        max_batch_size=server.max_batch_size,
        kv_budget=server.kv_budget_tokens,
        speculation=server.speculation,
    )


def build_app(
    server: ServerConfig,
    decode: DecodeConfig,
    target_cfg: ModelConfig,
    draft_cfg: ModelConfig,
    world: WorldConfig | None = None,
):
    """Load the pair named by the configs and return the FastAPI app serving it."""

    target, draft, tokenizer = load_pair(target_cfg, draft_cfg, world)
    engine = build_engine(target, draft, tokenizer, decode, server)
    max_len = context_length(target, draft, server)
    log.info(
        "serving %s (target %s, draft %s) rule=%s tree=%s, context %d, max batch %d",
        server.model_name,
        target_cfg.path,
        draft_cfg.path,
        decode.rule,
        decode.tree,
        max_len,
        server.max_batch_size,
    )
    return create_app(engine, tokenizer, server, decode, max_model_len=max_len)


def serve(
    server: ServerConfig,
    decode: DecodeConfig,
    target_cfg: ModelConfig,
    draft_cfg: ModelConfig,
    world: WorldConfig | None = None,
) -> None:
    """Build the app and serve it until interrupted."""
    import uvicorn

    app = build_app(server, decode, target_cfg, draft_cfg, world)
    # one worker process: the decoding worker thread owns the models
    uvicorn.run(app, host=server.host, port=server.port, log_level=server.log_level, workers=1)
