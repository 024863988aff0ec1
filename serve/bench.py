"""End-to-end speedup report:  python serve/bench.py [+recipe=NAME] [key=value ...]

  python serve/bench.py                        # the tiny pair: AR vs each rule x tree, HF assisted; report.md/json/png
  python serve/bench.py +recipe=debug          # the micro pair, a few seconds of work
  python serve/bench.py bench.random_pair=true # a random pair shaped like the tiny world: speed only, no world needed
  python serve/bench.py bench.draft_label=initial "+bench.drafts={distilled: 'outputs/distill/tiny/latest/draft'}"
  python serve/bench.py --server http://127.0.0.1:8000 bench.num_requests=32   # load sweep, bench.concurrencies
  python serve/bench.py --server ar=http://127.0.0.1:8001 --server adaptive=http://127.0.0.1:8002 bench.rounds=2
                                               # several servers in one interleaved sweep, with their ratios

Outputs go to bench.output_dir, else the Hydra run folder (outputs/bench/<name>/<time>/).
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from resispec.config import register_configs, to_typed
from resispec.errors import exit_on_user_error

register_configs()


def _server_flag_to_override(argv: list[str]) -> list[str]:
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
    from resispec.serving.loadtest import parse_servers

    servers = parse_servers(c.bench.server_url, c.bench.server_urls)
    if servers:
        from resispec.data.prompts import load_heldout_prompts
        from resispec.models.loading import load_tokenizer
        from resispec.serving.loadtest import run_interleaved
        from resispec.serving.text import decode_ids

        tokenizer = load_tokenizer(c.target, c.world)
        prompts = [
            decode_ids(tokenizer, p)
            for p in load_heldout_prompts(c.data, tokenizer, c.world, c.bench.num_prompts)
        ]
        api_key = c.server.api_key or os.environ.get("RESISPEC_API_KEY") or None
        run_interleaved(servers, prompts, c.bench, api_key=api_key, output_dir=out_dir)
        return
    from resispec.serving.bench import run_bench

    run_bench(c.bench, c.decode, c.target, c.draft, c.world, c.data, c.logger, out_dir, run_name=c.name)


if __name__ == "__main__":
    sys.argv[1:] = _server_flag_to_override(sys.argv[1:])
    main()
