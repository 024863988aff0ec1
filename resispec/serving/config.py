"""Typed config for the OpenAI-compatible server (Hydra group `server`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "resispec"  # the id /v1/models reports and requests must name
    # or env RESISPEC_API_KEY; when set, requests need `Authorization: Bearer <key>`
    api_key: str | None = None
    max_queue: int = 64  # requests waiting for the decoding worker; more get 503
    max_batch_size: int = 8  # requests decoded together (continuous batching); 1 = one at a time
    speculation: str = (
        "auto"  # draft per step: auto (when measured cheaper at this batch size) | always | never
    )
    # seeded sampled requests: invariant (noise keyed by token position, verified with the gumbel rule: the same
    # tokens with or without speculation, any tree or load, so the adaptive policy may back off for them; ~10%
    # lower tau than resispec on the tiny pair) | rule (the configured rule with a seeded stream: its tau, but the
    # tokens then depend on which steps drafted, i.e. on the load)
    seeded_sampling: str = "invariant"
    kv_budget_tokens: int | None = None  # KV bound: rows x longest prompt+max_tokens; null = none
    # newcomers are prefilled together, in one target forward: at most this many prompt tokens per forward (at
    # least one request). While others run, one such block joins per step boundary, so running streams stall for
    # at most one prefill forward of this size (one request at a time: set it to 1)
    max_prefill_tokens: int = 2048
    # chunked prefill: while others run, a newcomer whose prompt is longer than this is prefilled in parts of this
    # many tokens, one part per step boundary, and joins with the last, so a long prompt delays the running
    # streams' next tokens by one part's forward, not by its whole prefill (vLLM's chunked prefill). 0 = off
    prefill_chunk_tokens: int = 256
    # prompt K/V kept for reuse (automatic prefix caching, as vLLM and SGLang do): a prompt seen before is not
    # prefilled again, one sharing a block-aligned prefix (16 tokens) with a stored one prefills only the rest;
    # finished requests leave their prompt + output behind (a chat's next turn). At most this many tokens are
    # stored per model (least recently used evicted), beside the batch cache and outside kv_budget_tokens: their
    # K/V bytes, e.g. ~24 KB a token for the tiny target, 128 KB for Llama 3 8B in bf16 (8192 tokens: 1 GiB).
    # 0 = off. Batched serving only (max_batch_size > 1)
    prefix_cache_tokens: int = 8192
    # torch threads of the decoding thread; null = all cores (all but one on the HF forward: serving_threads)
    num_threads: int | None = None
    # while fewer requests than this run, decoding uses one thread fewer and leaves that core to the HTTP frontend
    # and the clients (0 = never). On 2 cores, out of process, T = 1: at 1-4 clients one thread gave 1.05-1.34x the
    # tokens/s of two (adaptive) and 1.03-1.20x (AR); at 8 they tie; at 16 two gave 1.07-1.15x (docs/journal/vllm.md)
    spare_core_below: int = 5
    max_tokens_default: int = 128  # when a request gives no max_tokens (capped by the context left)
    max_model_len: int | None = None  # context length; null = the smaller max_position_embeddings of the pair
    max_body_bytes: int = 2 * 1024 * 1024  # larger request bodies get 413 at once (a 128k-token prompt fits)
    max_stop_strings: int = 16  # more stop strings get 400 (OpenAI allows 4)
    max_stop_length: int = 512  # characters per stop string; longer get 400
    log_level: str = "info"
