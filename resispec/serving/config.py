"""Typed config for the OpenAI-compatible server and the benchmark (Hydra groups `server`, `bench`)."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class BenchConfig:
    num_prompts: int = 8
    warmup: int = 1  # warm-up generations per method before timing (never timed)
    max_new_tokens: int = 64
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    rules: list[str] = field(
        default_factory=lambda: [
            "chain",
            "rrs",
            "kseq",
            "rsd",
            "hub",
            "gumbel",
            "onehot",
            "resispec",
            "resispec_auto",
        ]
    )
    trees: list[list[int]] = field(default_factory=lambda: [[1, 1, 1, 1], [4, 2, 1, 1]])
    hf_assisted: bool = True
    hf_num_assistant_tokens: list[int] | None = None  # chain lengths tried for HF; null = lengths of `trees`
    drafts: dict[str, str] = field(default_factory=dict)  # extra drafts to compare: label -> path
    # per-draft rules (label -> rules) where a draft needs fewer rows than `rules`, e.g. the main job's
    # {initial: [chain, resispec]}: the initial draft is the before, not the object of the comparison
    draft_rules: dict[str, list[str]] = field(default_factory=dict)
    draft_label: str = "draft"  # label of the configured `draft` in the report
    server_url: str | None = None  # load-test a running server instead (localhost only)
    # several running servers compared in one run: "LABEL=URL" (or a URL, labelled by its host:port), every level swept
    # on each in turn (ABBA over bench.rounds), merged per (server, level); the report adds their ratios to the first
    server_urls: list[str] = field(default_factory=list)
    concurrency: int = 8
    num_requests: int = 32
    concurrencies: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])  # the load sweep's levels
    ignore_eos: bool = True  # load test: every request runs to max_tokens, so lost tokens show
    # load test: 0 = every request asks max_new_tokens; r > 0 = request i asks a length drawn uniformly from
    # [max_new_tokens (1 - r), max_new_tokens (1 + r)], the same on every server (vLLM's --random-range-ratio).
    # (equal lengths let batched AR rows run in lockstep waves; four runs did not show that it matters beyond the
    # run-to-run noise: docs/journal/vllm.md, "Unequal request lengths")
    output_len_range_ratio: float = 0.0
    # load sweep and in-process comparison (python -m resispec.serving.loadtest): rounds of the whole sweep, every
    # server or mode in turn at each level, merged per (server, level); on a machine whose speed drifts within minutes
    # one round is noise
    rounds: int = 1
    # in-process comparison: the serving modes to compare (labels of loadtest.serving_modes); empty = all five
    modes: list[str] = field(default_factory=list)
    # load test: each request carries a seed (bench.seed + i); false sends unseeded requests, as most clients do (our
    # server decodes a seeded request with server.seeded_sampling)
    seeded_requests: bool = True
    seed: int = 0
    output_dir: str | None = None  # default: the Hydra run folder
    # tree=auto rows: for each of these rules the planner (resispec/decoding/planner.py) picks the tree from this
    # device's measured costs and the rule's calibrated acceptance; the report shows predicted vs measured
    plan_rules: list[str] = field(default_factory=lambda: ["resispec", "resispec_auto"])
    plan_calibration_prompts: int = 4  # validation prompts (+ the target's continuations) for the calibration
    # also time the decoder on the HF forward (fast_forward=False) for every rule x tree, interleaved: the fast
    # forward's before/after in one run ("ref[...]" rows; the reference step itself is tests/oracle_decoder.py)
    reference_step: bool = False
    # time a random-weight pair shaped like the tiny world (no built world, random prompts): speed only, tau is noise
    random_pair: bool = False
    # vLLM as a peer (resispec/serving/vllm_peer.py; needs scripts/setup_vllm.sh): vLLM AR and vLLM with each draft
    vllm: bool = False
    vllm_python: str | None = None  # the vLLM venv's python; null = $RESISPEC_VLLM_PYTHON or .venv-vllm
    vllm_k: list[int] | None = None  # chain lengths; null = those of the chain trees in `trees`, else [2]
    vllm_drafting: list[str] = field(default_factory=lambda: ["greedy", "probabilistic"])
    vllm_env: dict[str, str] = field(default_factory=dict)  # extra env for the servers
    vllm_args: list[str] = field(default_factory=list)  # extra server arguments, e.g. [--enforce-eager]
    # work around vllm#55005 (CPU, T > 0, draft); rows labelled +fix#55005
    vllm_fix_cpu_sampling: bool = False
