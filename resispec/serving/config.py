"""Typed config for the OpenAI-compatible server and the benchmark (Hydra groups `server`, `bench`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "resispec"  # the id /v1/models reports and requests must name
    api_key: str | None = None  # or env RESISPEC_API_KEY; when set, requests need `Authorization: Bearer <key>`
    max_queue: int = 64
    max_tokens_default: int = 128
    log_level: str = "info"


@dataclass
class BenchConfig:
    num_prompts: int = 8
    warmup: int = 1
    max_new_tokens: int = 64
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    rules: list[str] = field(default_factory=lambda: ["chain", "rrs", "kseq", "rsd", "hub", "gumbel",
                                                      "onehot", "resispec", "resispec_auto"])
    trees: list[list[int]] = field(default_factory=lambda: [[1, 1, 1, 1], [4, 2, 1, 1]])
    hf_assisted: bool = True
    drafts: dict[str, str] = field(default_factory=dict)  # extra drafts to compare: label -> path
    server_url: str | None = None  # load-test a running server instead (localhost only)
    concurrency: int = 8
    num_requests: int = 32
    seed: int = 0
    output_dir: str | None = None
