"""How long running streams stall while long prompts join (chunked prefill, `server.prefill_chunk_tokens`): K
streaming clients send short prompts back to back, and one more client sends a long prompt (new words each time, so
the prefix cache cannot help) every second after its previous one is answered. Prints the short streams' gaps
between two SSE chunks (p50, p99, max) and the long requests' time to first token.

python serve/server.py draft.path=<draft> server.prefill_chunk_tokens=0    # or 256, 512, ...
python bench/experiments/prefill_stalls.py --url http://127.0.0.1:8000 [--long-words 800] [--seconds 40] [--clients 4]

On the tiny world 800 words are ~880 tokens. Compare settings with one server at a time, alternating, several runs:
the machine's speed drifts by tens of percent within minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from resispec.benchmark.config import BenchConfig
from resispec.benchmark.load import one_request
from resispec.benchmark.results import percentile

BENCH = BenchConfig(seeded_requests=False)  # unseeded, ignore_eos: every request runs to its max_tokens
WORDS = "the of and to in is was for on that with as by at from his her an which or be are this".split()


def text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def run(args) -> None:
    gaps, ttfts = [], []
    stop = time.perf_counter() + args.seconds
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def short(i: int) -> None:
            k = 0
            while time.perf_counter() < stop:
                gaps.extend((await one_request(client, model, text(40, 1000 * i + k), BENCH, 1.0, 0, 48))[3])
                k += 1

        async def long() -> None:
            k = 0
            await asyncio.sleep(1.0)
            while time.perf_counter() < stop - 2:
                ttfts.append(
                    (await one_request(client, model, text(args.long_words, 10**6 + k), BENCH, 1.0, 0, 8))[1]
                )
                k += 1
                await asyncio.sleep(1.0)

        await asyncio.gather(*(short(i) for i in range(args.clients)), long())
    ms = {q: 1e3 * percentile(gaps, q) for q in (50, 99, 100)}
    print(
        f"short streams: {len(gaps)} gaps, p50 {ms[50]:.1f} ms, p99 {ms[99]:.1f} ms, max {ms[100]:.1f} ms; "
        f"long prompts ({len(ttfts)}): TTFT {min(ttfts):.3f}-{max(ttfts):.3f} s, median {percentile(ttfts, 50):.3f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--long-words", type=int, default=800)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--clients", type=int, default=4)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
