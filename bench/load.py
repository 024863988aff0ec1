"""Serving under load:  python bench/load.py [--server [LABEL=]URL ...] [+recipe=NAME] [key=value ...]

  python bench/load.py +recipe=tiny bench.rounds=3           # every serving mode in one process (the configured
                                                             # pair), interleaved rounds: sweep.md / .json / .png
  python bench/load.py --server http://127.0.0.1:8000 bench.num_requests=32   # a running server, bench.concurrencies
  python bench/load.py --server ar=http://127.0.0.1:8001 --server adaptive=http://127.0.0.1:8002 bench.rounds=2
                                                             # several servers in one interleaved sweep, their ratios

Localhost servers only. Outputs go to bench.output_dir, else the Hydra run folder (outputs/bench/<name>/<time>/).
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from resispec.benchmark.inprocess import compare_in_process
from resispec.benchmark.load import parse_servers, run_interleaved
from resispec.config import register_configs, to_typed
from resispec.data.prompts import load_heldout_prompts
from resispec.errors import exit_on_user_error
from resispec.models import load_pair
from resispec.models.loading import load_tokenizer
from resispec.serving.server import context_length, off_main_thread
from resispec.serving.text import decode_ids

register_configs()


def server_flag_to_override(argv: list[str]) -> list[str]:
    """`--server URL` / `--server=URL` -> the Hydra override `bench.server_url=URL`; several `--server` flags, or
    one `--server LABEL=URL`, -> `bench.server_urls=[...]` (one interleaved sweep of them all)."""
    out, servers, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--server" and i + 1 < len(argv):
            servers.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--server="):
            servers.append(arg.split("=", 1)[1])
        else:
            out.append(arg)
        i += 1
    if len(servers) == 1 and "=" not in servers[0]:
        return [f"bench.server_url={servers[0]}", *out]
    if servers:  # quoted, so that labels may hold spaces and the values '=' and ':'
        quoted = ",".join("'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'" for s in servers)
        return [f"bench.server_urls=[{quoted}]", *out]
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    c = to_typed(cfg)
    out_dir = c.bench.output_dir or HydraConfig.get().runtime.output_dir
    servers = parse_servers(c.bench.server_url, c.bench.server_urls)
    if servers:  # running servers: only the tokenizer, for the prompts' text
        tokenizer = load_tokenizer(c.target, c.world)
    else:  # every serving mode in this process, on the configured pair
        target, draft, tokenizer = off_main_thread(load_pair, c.target, c.draft, c.world)
    prompts = [
        decode_ids(tokenizer, p)
        for p in load_heldout_prompts(c.data, tokenizer, c.world, c.bench.num_prompts)
    ]
    if servers:
        api_key = c.server.api_key or os.environ.get("RESISPEC_API_KEY") or None
        run_interleaved(servers, prompts, c.bench, api_key=api_key, output_dir=out_dir)
        return
    max_model_len = context_length(target, draft, c.server)
    compare_in_process(
        target, draft, tokenizer, c.decode, prompts, c.bench, max_model_len=max_model_len, output_dir=out_dir
    )
    print(f"report: {out_dir}/sweep.md, {out_dir}/sweep.png")


if __name__ == "__main__":
    sys.argv[1:] = server_flag_to_override(sys.argv[1:])
    main()
